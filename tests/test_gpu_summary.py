"""tools/gpu_summary.py: the GPU run's headline figures from the raw results of
tools/gpu_check.sh (device, commit, the attention per call, the step at micro-batch 8); a run cut
short leaves nulls."""

import json
import os
import subprocess
import sys
from pathlib import Path


def test_the_summary_takes_the_figures_the_issues_name(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "environment.json").write_text(
        json.dumps({"device": "NVIDIA H100", "driver": "580", "torch": "2.11.0", "triton": "3.6"})
    )
    rows = [
        {"model": "GPT-3 350M", "seq": 2048, "implementation": name, "status": "ok",
         "fwd_bwd_ms": ms}
        for name, ms in (("flash", 1.5), ("flash_unchecked", 1.4), ("sdpa_flash", 0.6))
    ] + [
        {"model": "GPT-3 350M", "seq": 2048, "implementation": "sdpa_cudnn", "status": "oom",
         "fwd_bwd_ms": None},
        {"model": "Llama-2 7B", "seq": 2048, "implementation": "flash", "status": "ok",
         "fwd_bwd_ms": 9.0},
    ]  # fmt: skip
    (raw / "bench_attention.json").write_text(json.dumps({"rows": rows}))
    step = {"args": {"micro_batch": 8}, "overhead": {"all": {"step": 0.04}}}
    (raw / "bench_gpt3_350m_mb8_flash.json").write_text(json.dumps(step))
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
    }
    assert made["step"]["flash"] == {"micro_batch": 8, "overhead": 0.04}
    assert made["step"]["unfused"] == {"micro_batch": None, "overhead": None}
