"""tools/gemm_detection.py at a small size: the checked GEMM (Triton's interpreter, a GPU's
tile) flags a bf16 scores error far smaller than the checks after the GEMM can (which see it
after the output's rounding), each limit found by a bisection whose ends are flagged and not."""

import argparse
import json

import pytest

from bench import gemm_detection as tool


def test_the_checked_gemm_finds_smaller_errors_than_the_checks_after_it(tmp_path):
    out = tmp_path / "detection.json"
    argv = ["--hidden", "64", "--heads", "1", "--seq", "128", "--dtypes", "bf16"]
    assert tool.main([*argv, "--sections", "scores", "--steps", "8", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    found = report["limit_over_window_rms"]["bf16"]["scores"]
    assert report["tile"]["block_n"] == 128
    # bf16's rounding of the output bounds the checks after the GEMM near the window's RMS;
    # the kernel checks its fp32 accumulators, under a bound a few hundredths of it
    assert 0 < found["checked_gemm"] < 0.1 < found["after"] < 10


@pytest.mark.parametrize("check", ["checked_gemm_flags", "after_flags"])
def test_a_limit_is_flagged_and_a_third_of_it_is_not(check):
    args = argparse.Namespace(hidden=64, heads=1, seq=128, block=256, tile="gpu")
    gemm = tool.Gemm("proj", args, tool.PRECISIONS["bf16"][0])
    flags = getattr(gemm, check)
    at = tool.positions(gemm.acc)[0]
    found = tool.limit(gemm, flags, at, 8)
    r, c = at
    window = gemm.acc[max(r - 16, 0) : r + 16, max(c - 16, 0) : c + 16]
    rms = window.pow(2).mean().sqrt().item()
    clean = gemm.acc[r, c].item()
    assert flags(at, clean + found * rms) and not flags(at, clean + found / 3 * rms)
