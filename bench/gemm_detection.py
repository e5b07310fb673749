"""Detection limit of the checked GEMM against the checks after the GEMM: the smallest finite
error of one element of each forward GEMM's output that each flags, relative to the RMS of the
32 x 32 window of the output around it, found by bisection at a few positions (the largest is
the section's limit).

    python -m tools.gemm_detection --json out/gemm_detection.json

The checked GEMM (megatron_abft.ops.checked_gemm) runs in Triton's interpreter on CPU tensors,
on a GPU's tile unless told otherwise, the error written into its fp32 accumulator before the
check (its ``fault``); the checks after the GEMM (megatron_abft.check.eec.verify_and_correct,
both sides with operands, as the protected layers run them) see the same error in the output,
rounded to its dtype. Inputs: tools.gemm_false_alarms's ``normal`` kind at a small size.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench.detection import smallest_flagged, write_report
from bench.gemm_false_alarms import PRECISIONS, operands
from megatron_abft.check.checksum import encode
from megatron_abft.check.eec import GemmOperands, verify_and_correct
from megatron_abft.config import CLEAN, FORWARD_SECTIONS
from megatron_abft.ops import checked_gemm

TILES = {"gpu": checked_gemm.GPU_TILES[True], "interpreter": checked_gemm.INTERPRETED}


class Gemm:
    """One section's GEMM ``alpha a @ b + bias`` in ``dtype`` and the two checks of it; errors
    go into its first matrix (a projection's, or head 0's)."""

    def __init__(self, section: str, args, dtype: torch.dtype):
        g = torch.Generator().manual_seed(0)
        a, b, alpha, bias = operands(section, "normal", args, g, dtype)
        self.a, self.b = a.to(dtype), b.to(dtype)
        self.bias = None if bias is None else bias.to(dtype)
        self.alpha, self.tile = alpha, TILES[args.tile]
        acc = self.a.double() @ self.b.double()  # 16-bit products are exact in float64
        self.acc = acc.view(-1, *acc.shape[-2:])[0]
        """The first matrix's accumulator, as the kernel holds it (to fp32's rounding)."""
        out = alpha * acc if self.bias is None else alpha * acc + self.bias.double()
        self.out = out.to(dtype)
        self.refs = encode(self.a, self.b, alpha=alpha, bias=self.bias, block=args.block)

    def checked_gemm_flags(self, at: tuple[int, int], value: float) -> bool:
        """Whether the checked GEMM flags the accumulator's element ``at`` set to ``value``."""
        if self.a.dim() == 2:
            _, codes = checked_gemm.checked_linear(
                self.a, self.b.t().contiguous(), self.bias, fault=(*at, value, True),
                tile=self.tile,
            )  # fmt: skip
        else:
            _, codes = checked_gemm.checked_matmul(
                self.a[None], self.b.mT[None], alpha=self.alpha, fault=(0, *at, value, True),
                tile=self.tile,
            )  # fmt: skip
        return bool(codes.any())

    def after_flags(self, at: tuple[int, int], value: float) -> bool:
        """Whether the checks after the GEMM flag its output with the element ``at`` made from
        the accumulator ``value`` (and rounded to the output's dtype)."""
        out = self.out.clone()
        r, c = at
        bias = 0.0 if self.bias is None else float(self.bias[c])
        out.view(-1, *out.shape[-2:])[0, r, c] = self.alpha * value + bias
        found = verify_and_correct(
            out, *self.refs, operands=GemmOperands(self.a, self.b, self.alpha, self.bias)
        )
        return bool((found.status != CLEAN).any())


def positions(acc: torch.Tensor) -> list[tuple[int, int]]:
    """Late rows, where a row's check has summed many products, at a middle column."""
    m, n = acc.shape
    return [(r, n // 2 + 1) for r in (m - 3, (3 * m) // 4, m // 2 + 1)]


def limit(gemm: Gemm, flags, at: tuple[int, int], steps: int) -> float:
    """The smallest error, relative to the window's RMS, that ``flags`` finds at ``at`` in the
    accumulator (bench.detection.smallest_flagged)."""
    return smallest_flagged(gemm.acc, at, lambda value: flags(at, value), steps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--block", type=int, default=256, help="the after-GEMM checks' block")
    parser.add_argument("--tile", choices=sorted(TILES), default="gpu", help="the kernel's tile")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16", "fp16"], choices=PRECISIONS)
    parser.add_argument("--sections", nargs="+", default=list(FORWARD_SECTIONS))
    parser.add_argument("--steps", type=int, default=12, help="bisection steps (x1.26 at 12)")
    parser.add_argument("--json", type=Path, default=Path("out/gemm_detection.json"))
    args = parser.parse_args(argv)
    start = time.perf_counter()
    results: dict = {}
    for precision in args.dtypes:
        for section in args.sections:
            gemm = Gemm(section, args, PRECISIONS[precision][0])
            checks = {"checked_gemm": gemm.checked_gemm_flags, "after": gemm.after_flags}
            found = {
                name: max(limit(gemm, flags, at, args.steps) for at in positions(gemm.acc))
                for name, flags in checks.items()
            }
            results.setdefault(precision, {})[section] = found
            print(
                f"{precision:>5} {section:>8}  checked GEMM {found['checked_gemm']:.2e}  "
                f"after the GEMM {found['after']:.2e}  (x the window's RMS)",
                flush=True,
            )
    shape = {"hidden": args.hidden, "heads": args.heads, "seq": args.seq}
    write_report(
        args.json, "gemm_detection", argv, start, results, shape=shape,
        tile=vars(TILES[args.tile]), block=args.block,
    )  # fmt: skip
    return 0
