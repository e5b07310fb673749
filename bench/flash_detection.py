"""Detection limit of the flash kernels' checks: the smallest finite error of one element of a
section's matrix that its check flags, relative to the RMS of the 32 x 32 window of the matrix
around it, found by bisection at a few positions (the largest of them is the section's limit).

    python -m tools.flash_detection --json out/flash_detection.json

Runs the kernels in Triton's interpreter on CPU tensors (IEEE fp32 accumulation), one (batch,
head), causal, standard normal inputs; each run checks only the section under test.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench.detection import smallest_flagged, write_report
from megatron_abft.config import FLASH_SECTIONS
from megatron_abft.faults import TensorFault
from megatron_abft.flash import FlashFault, FlashLedger, flash_attention
from megatron_abft.flash.faults import first_computations


def positions(section: str, seq: int, matrix: torch.Tensor) -> list[tuple[int, int]]:
    """Elements of the section's matrix to perturb: late rows, where a row has seen many tiles;
    for S and dP a visible (causal) column in the middle of the row. A row whose first
    computation is all zeros (in dK/dV, a key that its block's first query tile does not see)
    gives way to the nearest earlier row that has one: an error there has a size to scale."""
    found = []
    for r in (seq - 3, (3 * seq) // 4, seq // 2 + 1):
        while r > 0 and not matrix[r].any():
            r -= 1
        found.append((r, r // 2) if section in ("scores", "bwd_scores", "grad_probs") else (r, 5))
    return found


def flagged(q, k, v, do, section: str, at: tuple[int, int], value: float) -> bool:
    ledger = FlashLedger.on(q.device)
    fault = FlashFault(section, TensorFault("value", value=value, position=at, batch_index=0))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = flash_attention(*leaves, sections=(section,), ledger=ledger, faults=[fault])
    if section not in ("scores", "context"):
        out.backward(do)
    return int(ledger.counts[FLASH_SECTIONS.index(section)].sum()) > 0


def limit(q, k, v, do, section, at, matrix, steps: int) -> float:
    """The smallest relative error flagged at ``at`` (bench.detection.smallest_flagged)."""
    return smallest_flagged(
        matrix, at, lambda value: flagged(q, k, v, do, section, at, value), steps
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"])
    parser.add_argument("--steps", type=int, default=10, help="bisection steps (x1.3 at 10)")
    parser.add_argument("--sections", nargs="+", default=list(FLASH_SECTIONS))
    parser.add_argument("--json", type=Path, default=Path("out/flash_detection.json"))
    args = parser.parse_args(argv)
    start = time.perf_counter()
    results = {}
    for name in args.dtypes:
        dtype = getattr(torch, name)
        g = torch.Generator().manual_seed(0)
        q, k, v, do = (
            torch.randn(1, 1, args.seq, args.dim, generator=g).to(dtype) for _ in range(4)
        )
        matrices = first_computations(q, k, v, do)
        for section in args.sections:
            limits = [
                limit(q, k, v, do, section, at, matrices[section], args.steps)
                for at in positions(section, args.seq, matrices[section])
            ]
            results.setdefault(name, {})[section] = max(limits)
            print(name, section, [f"{x:.2e}" for x in limits], flush=True)
    write_report(args.json, "flash_detection", argv, start, results, seq=args.seq, dim=args.dim)
    return 0
