"""tools/gemm_false_alarms.py at a small size: the unfused path's checked GEMMs on clean inputs
of every kind (outliers, heavy tails, an attention sink) raise no alarm in fp32, bf16 and fp16,
and every residual sits inside its threshold."""

import json

from megatron_abft.config import FORWARD_SECTIONS


def test_clean_gemms_raise_no_alarm(tmp_path):
    out = tmp_path / "alarms.json"
    from bench import gemm_false_alarms as tool

    tool.main(
        ["--hidden", "128", "--heads", "2", "--seq", "128", "--repeats", "1", "--json", str(out)]
        + ["--dtypes", "fp32", "bf16", "fp16"]
    )
    report = json.loads(out.read_text())
    assert report["false_alarms"] == 0
    rows = report["rows"]
    assert {(r["section"], r["inputs"]) for r in rows} == {
        (s, k) for s in FORWARD_SECTIONS for k in tool.KINDS_OF_INPUT
    }
    assert all(0 < r["worst_share_of_threshold"] < 1 for r in rows), rows
    assert all(r["overflowed_repeats"] == 0 for r in rows)


def test_the_checked_gemm_flags_no_clean_tile_and_says_its_margin(tmp_path):
    """In Triton's interpreter (bf16 from fp32 copies), the projections and the attention's
    scores and context: no tile flagged at the bound, and a margin of at least 4 (none flagged
    at a quarter of it)."""
    out = tmp_path / "alarms.json"
    from bench import gemm_false_alarms as tool

    tool.main(
        ["--hidden", "64", "--heads", "2", "--seq", "64", "--repeats", "1", "--json", str(out)]
        + ["--dtypes", "bf16", "--checked-gemm"]
    )
    report = json.loads(out.read_text())
    assert report["false_alarms"] == 0
    fused = [r for r in report["rows"] if "checked_gemm_clean_scale" in r]
    assert {r["section"] for r in fused} == set(FORWARD_SECTIONS) and len(fused) == 16
    assert all(r["checked_gemm_tiles_flagged"] == 0 for r in fused)
    assert all(r["checked_gemm_clean_scale"] <= 0.25 for r in fused), fused
