"""The GPU run's headline figures in one file, from the raw results tools/gpu_check.sh leaves:

    python -m tools.gpu_summary RAW_DIR --out docs/figures/gpu/summary.json

RAW_DIR holds ``environment.json`` (the device), ``bench_attention.json``
(tools.bench_attention), ``bench_gpt3_350m_mb8_{flash,unfused}[_checked_gemm].json``
(tools.bench_overhead at micro-batch 8, the ``_checked_gemm`` runs with
ABFTConfig.checked_gemm; the micro-batch-1 runs beside them are kept as raw files) and
``bench_kernels.json`` (tools.bench_kernels: the projections' checks against their GEMMs, and
the checked GEMM's time over theirs and over the attention's GEMMs, the checksum kernels' read
rates as fractions of a copy's). A figure whose run did not finish is null.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
from pathlib import Path

ATTENTION = {
    "checked_ms": "flash",
    "unchecked_ms": "flash_unchecked",
    "sdpa_flash_ms": "sdpa_flash",
    "sdpa_cudnn_ms": "sdpa_cudnn",
    "unfused_ms": "megatron_unfused",
    "unfused_checked_ms": "protected_unfused",
    "unfused_checked_gemm_ms": "protected_unfused_checked_gemm",
}
"""summary.json's fields of the attention and bench_attention's implementations: fwd+bwd (the
protected flash attention checked and not, SDPA's, Megatron's unfused attention and the
protected one, its checks after its GEMMs or by the checked GEMM)."""


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def attention(raw: dict | None, model: str = "GPT-3 350M", seq: int = 2048) -> dict:
    """Per implementation, the median fwd+bwd time of one call at ``model``'s shape."""
    rows = [r for r in (raw or {}).get("rows", []) if r["model"] == model and r["seq"] == seq]
    by_name = {r["implementation"]: r for r in rows if r["status"] == "ok"}
    return {
        field: by_name[name]["fwd_bwd_ms"] if name in by_name else None
        for field, name in ATTENTION.items()
    }


def step(raw: dict | None) -> dict:
    """A step's overhead with every section checked, as a fraction, and its micro-batch."""
    if raw is None:
        return {"micro_batch": None, "overhead": None}
    return {"micro_batch": raw["args"]["micro_batch"], "overhead": raw["overhead"]["all"]["step"]}


def kernels(raw: dict | None) -> dict:
    """The projections' clean checks as fractions of their GEMMs' time (and the shape; ``floor``,
    a read of each output as the same fraction, and ``checked_gemm``, what the checked GEMM
    takes over the GEMM, where the run measured them), the checked GEMM's time over Megatron's
    for the attention's scores and context (``attention_gemms``), and each checksum kernel's
    read rate as a fraction of a copy's."""
    if raw is None:
        return {"projections": None, "attention_gemms": None, "checksum_kernels_of_copy": None}
    projected, attention_gemms = raw["projections"], raw.get("attention_gemms")
    return {
        "projections": {
            "tokens": projected["tokens"],
            "hidden": projected["hidden"],
            **{s: projected[s]["fraction"] for s in ("qkv", "proj")},
            "floor": {s: projected[s].get("floor_fraction") for s in ("qkv", "proj")},
            "checked_gemm": {s: projected[s].get("checked_gemm_fraction") for s in ("qkv", "proj")},
        },
        "attention_gemms": attention_gemms
        and {s: attention_gemms[s]["checked_gemm_fraction"] for s in ("scores", "context")},
        "checksum_kernels_of_copy": {k: v["of_copy"] for k, v in raw["kernels"].items()} or None,
    }


def commit() -> str | None:
    """``ABFT_COMMIT`` (the device machine's copy of the tree has no git history), else HEAD."""
    if os.environ.get("ABFT_COMMIT"):
        return os.environ["ABFT_COMMIT"]
    made = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    return made.stdout.strip() or None


def summary(raw_dir: Path, date: str | None = None, at: str | None = None) -> dict:
    environment = _read(raw_dir / "environment.json") or {}
    return {
        "device": environment.get("device"),
        "date": date or datetime.date.today().isoformat(),
        "commit": at if at is not None else commit(),
        "versions": {k: environment.get(k) for k in ("driver", "torch", "cuda", "triton")},
        "attention": {"gpt3_350m_s2048": attention(_read(raw_dir / "bench_attention.json"))},
        "step": {
            path: step(_read(raw_dir / f"bench_gpt3_350m_mb8_{path}.json"))
            for path in ("flash", "unfused", "flash_checked_gemm", "unfused_checked_gemm")
        },
        **kernels(_read(raw_dir / "bench_kernels.json")),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("raw", type=Path, help="the directory of the run's raw results")
    parser.add_argument("--out", type=Path, default=Path("out/gpu/summary.json"))
    args = parser.parse_args(argv)
    made = summary(args.raw)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(made, indent=1) + "\n")
    print(json.dumps(made, indent=1))
    return 0
