"""tools/gpu_summary.py: the GPU run's headline figures from the raw results of
tools/gpu_check.sh (device, commit, the attention per call, the step at micro-batch 8, the
projections' checks against their GEMMs, the checksum kernels' read rates); a run cut short
leaves nulls. And tools/bench_kernels.py's JSON, which the summary reads."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_the_summary_takes_the_figures_the_issues_name(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "environment.json").write_text(
        json.dumps({"device": "NVIDIA H100", "driver": "580", "torch": "2.11.0", "triton": "3.6"})
    )
    rows = [
        {"model": "GPT-3 350M", "seq": 2048, "implementation": name, "status": "ok",
         "fwd_bwd_ms": ms}
        for name, ms in (
            ("flash", 1.5), ("flash_unchecked", 1.4), ("sdpa_flash", 0.6),
            ("megatron_unfused", 7.0), ("protected_unfused_checked_gemm", 7.5),
        )
    ] + [
        {"model": "GPT-3 350M", "seq": 2048, "implementation": "sdpa_cudnn", "status": "oom",
         "fwd_bwd_ms": None},
        {"model": "Llama-2 7B", "seq": 2048, "implementation": "flash", "status": "ok",
         "fwd_bwd_ms": 9.0},
    ]  # fmt: skip
    (raw / "bench_attention.json").write_text(json.dumps({"rows": rows}))
    step = {"args": {"micro_batch": 8}, "overhead": {"all": {"step": 0.04}}}
    (raw / "bench_gpt3_350m_mb8_flash.json").write_text(json.dumps(step))
    projections = {"tokens": 16384, "hidden": 1024}
    projections |= {
        s: {"gemm_ms": 0.2, "check_ms": 0.2 * share, "fraction": share}
        for s, share in (("qkv", 0.05), ("proj", 0.01))
    }
    projections["qkv"]["checked_gemm_fraction"] = 0.03
    kernels = {"screen of S (a clean verify)": {"ms": 0.5, "of_copy": 0.75}}
    attention_gemms = {
        s: {"gemm_ms": 1.0, "checked_gemm_ms": 1.0 + f, "checked_gemm_fraction": f}
        for s, f in (("scores", 0.02), ("context", 0.04))
    }
    (raw / "bench_kernels.json").write_text(
        json.dumps(
            {"projections": projections, "kernels": kernels, "attention_gemms": attention_gemms}
        )
    )
    out = tmp_path / "summary.json"
    subprocess.run(
        [sys.executable, "-m", "tools.gpu_summary", str(raw), "--out", str(out)],
        check=True,
        cwd=Path(__file__).parents[1],  # the repository root, where the tools run from
        env={**os.environ, "ABFT_COMMIT": "abc123"},
    )
    made = json.loads(out.read_text())
    assert made["device"] == "NVIDIA H100" and made["commit"] == "abc123"
    assert made["attention"]["gpt3_350m_s2048"] == {
        "checked_ms": 1.5,
        "unchecked_ms": 1.4,
        "sdpa_flash_ms": 0.6,
        "sdpa_cudnn_ms": None,
        "unfused_ms": 7.0,
        "unfused_checked_ms": None,
        "unfused_checked_gemm_ms": 7.5,
    }
    assert made["step"]["flash"] == {"micro_batch": 8, "overhead": 0.04}
    for path in ("unfused", "flash_checked_gemm", "unfused_checked_gemm"):  # did not finish
        assert made["step"][path] == {"micro_batch": None, "overhead": None}
    assert made["projections"] == {
        "tokens": 16384,
        "hidden": 1024,
        "qkv": 0.05,
        "proj": 0.01,
        "floor": {"qkv": None, "proj": None},  # a run before the floor was measured
        "checked_gemm": {"qkv": 0.03, "proj": None},
    }
    assert made["attention_gemms"] == {"scores": 0.02, "context": 0.04}
    assert made["checksum_kernels_of_copy"] == {"screen of S (a clean verify)": 0.75}


def test_bench_kernels_writes_the_projections_and_kernels_the_summary_reads(tmp_path):
    """Timed for real on the CPU at a small shape: each projection's GEMM and clean check, the
    check's share of the GEMM, and each kernel's read rate against a copy's."""
    import torch

    from bench.gpu_summary import kernels
    from bench.kernels import main
    from megatron_abft.ops import compiled

    out = tmp_path / "bench_kernels.json"
    torch.manual_seed(0)
    shape = ["--seq", "64", "--heads", "2", "--head-dim", "16", "--batch", "1", "--dtype", "fp32"]
    main([*shape, "--repeat", "2", "--projection-tokens", "48", "--json", str(out)])
    raw = json.loads(out.read_text())
    projected = raw["projections"]
    assert (projected["tokens"], projected["hidden"]) == (48, 32)
    for section in ("qkv", "proj"):
        p = projected[section]
        assert p["gemm_ms"] > 0 and p["check_ms"] > 0
        assert p["fraction"] == p["check_ms"] / p["gemm_ms"]
        assert 0 < p["floor_ms"] and p["floor_fraction"] == p["floor_ms"] / p["gemm_ms"]
    assert bool(raw["kernels"]) == compiled.available()
    assert all(k["of_copy"] > 0 for k in raw["kernels"].values())
    read = kernels(raw)
    assert read["projections"]["qkv"] == projected["qkv"]["fraction"]
    assert read["projections"]["floor"]["proj"] == projected["proj"]["floor_fraction"]
    assert read["attention_gemms"] is None  # timed on GPUs only


def test_bench_kernels_times_a_projections_products_both_ways():
    """The products a bf16 projection's check needs, timed for real on the CPU by the products
    kernel and by mma_products, from the same block sums."""
    import torch

    from bench.kernels import products_both_ways
    from megatron_abft.ops import compiled

    if not compiled.available():
        pytest.skip(compiled.backend())
    x, w = torch.randn(64, 32).bfloat16(), torch.randn(96, 32).bfloat16()
    found = products_both_ways(x, w, 16, torch.device("cpu"), 2)
    assert set(found) == {"cuda_cores_ms", "tensor_cores_ms"}
    assert all(t > 0 for t in found.values())


def test_the_attention_gemms_are_timed_against_megatrons():
    """bench_kernels' attention_gemms, run here through Triton's interpreter at a tiny shape:
    every figure measured and the fraction the checked GEMM's time over Megatron's."""
    import torch

    from bench.kernels import attention_gemms

    q, k, v = (torch.randn(1, 2, 32, 16) for _ in range(3))
    found = attention_gemms(q, k, torch.rand(1, 2, 32, 32), v, 0.25, torch.device("cpu"), 1)
    assert set(found) == {"scores", "context"}
    for a in found.values():
        assert a["gemm_ms"] > 0 and a["checked_gemm_ms"] > 0 and a["triton_gemm_ms"] > 0
        assert a["checked_gemm_fraction"] == a["checked_gemm_ms"] / a["gemm_ms"] - 1
