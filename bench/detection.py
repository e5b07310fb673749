"""The bisection the detection-limit sweeps share (bench.flash_detection, bench.gemm_detection):
the smallest error of one element a check flags, relative to the RMS of the 32 x 32 window of
the matrix around it."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch


def smallest_flagged(
    matrix: torch.Tensor, at: tuple[int, int], flags: Callable[[float], bool], steps: int
) -> float:
    """The smallest ``r`` for which ``flags(matrix[at] + r * rms)`` holds, ``rms`` the window's
    around ``at``: bisection in log space between 1e-9 and 1e3, to ``12 / 2**steps`` decades;
    inf where even 1e3 is not flagged."""
    r, c = at
    window = matrix[max(r - 16, 0) : r + 16, max(c - 16, 0) : c + 16]
    rms = window.pow(2).mean().sqrt().item()
    clean = matrix[r, c].item()
    lo, hi = -9.0, 3.0  # log10 of the relative error
    if not flags(clean + 10**hi * rms):
        return math.inf
    for _ in range(steps):
        mid = (lo + hi) / 2
        if flags(clean + 10**mid * rms):
            hi = mid
        else:
            lo = mid
    return 10**hi


def write_report(path: Path, tool: str, argv: list[str] | None, started: float, results: dict,
                 **setting) -> None:  # fmt: skip
    """A sweep's JSON: the command that made it, its ``setting``, torch's version, its seconds
    since ``started`` (time.perf_counter) and the limits, by dtype and section."""
    report = {
        "command": f"python -m tools.{tool} " + " ".join(argv or []),
        **setting,
        "torch": torch.__version__,
        "seconds": round(time.perf_counter() - started),
        "limit_over_window_rms": results,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
