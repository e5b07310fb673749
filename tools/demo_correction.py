"""Demonstrate EEC-ABFT on attention scores: inject each kind of fault, correct it, print a table.

S = Q K^T / sqrt(d) for one tensor-parallel rank's heads, checked on both sides from checksums
of Q and K; each fault lands in S after the GEMM, as a soft error would.

    python -m tools.demo_correction [--seq 1024] [--heads 8] [--head-dim 64] [--dtype bf16]
"""

from __future__ import annotations

import argparse
import time

import torch

from megatron_abft import (
    GemmOperands,
    TensorFault,
    encode,
    inject_,
    report,
    verify_and_correct,
)
from megatron_abft.config import DTYPES

STATUS = {0: "clean", 1: "corrected", 2: "UNCORRECTABLE"}
CASES = [
    ("none", "0d", None),
    ("inf", "0d", None),
    ("-inf", "0d", None),
    ("nan", "0d", None),
    ("near_inf", "0d", None),
    ("bitflip", "0d", "exponent"),
    ("value", "0d", 1e3),
    ("inf", "row", None),
    ("nan", "col", None),
    ("near_inf", "row", None),
    ("inf", "2d", None),
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2, help="micro-batch size")
    parser.add_argument("--heads", type=int, default=8, help="attention heads on this rank")
    parser.add_argument("--seq", type=int, default=1024, help="sequence length")
    parser.add_argument("--head-dim", type=int, default=64, help="head dimension")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--block", type=int, default=256, help="checksum block length")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    dtype = DTYPES[args.dtype]
    g = torch.Generator().manual_seed(args.seed)
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    q = torch.randn(*shape, generator=g).to(dtype)
    k = torch.randn(*shape, generator=g).to(dtype)
    scale = args.head_dim**-0.5
    start = time.perf_counter()
    clean = (q @ k.mT * scale).to(dtype)
    gemm_ms = (time.perf_counter() - start) * 1e3
    exact = q.double() @ k.double().mT * scale
    torch_error = (clean.double() - exact).abs().max().item()
    col, row = encode(q, k.mT, alpha=scale, block=args.block)
    print(
        f"scores S = Q K^T / sqrt(d): {args.batch}x{args.heads} matrices of "
        f"{args.seq}x{args.seq} in {args.dtype}, checksum blocks of {args.block}; "
        f"torch's own error vs fp64: {torch_error:.2e}; the GEMM took {gemm_ms:.0f} ms\n"
    )
    header = f"{'fault':<10} {'pattern':<7} {'status':<14} {'counters d/c/u':<15} "
    print(header + f"{'max |S - fault-free|':>21} {'ms':>7}")
    print("-" * (len(header) + 29))
    for i, (kind, pattern, extra) in enumerate(CASES):
        s = clean.clone()
        if kind != "none":
            fault = TensorFault(
                kind,
                pattern,
                bit=torch.finfo(dtype).bits - 2 if kind == "bitflip" else None,
                value=extra if kind == "value" else None,
                seed=args.seed + i,
            )
            inject_(s, fault)
        start = time.perf_counter()
        result = verify_and_correct(s, col, row, operands=GemmOperands(q, k.mT, scale))
        elapsed = (time.perf_counter() - start) * 1e3
        counts = {name: sum(v.values()) for name, v in report(result).items()}
        worst = int(result.status.max())
        deviation = (s.double() - clean.double()).abs().max().item()
        counters = f"{counts['detected']}/{counts['corrected']}/{counts['uncorrectable']}"
        print(
            f"{kind:<10} {pattern:<7} {STATUS[worst]:<14} {counters:<15} "
            f"{deviation:>21.3g} {elapsed:>7.1f}"
        )
    print(
        "\ncorrected: S equals the fault-free scores (recomputed elements round like the GEMM);"
        "\nUNCORRECTABLE: reported and left as the GEMM produced it, for the configured policy."
    )


if __name__ == "__main__":
    main()
