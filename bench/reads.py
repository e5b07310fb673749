"""How fast the checksum kernels read a matrix on this machine, by its size, its layout and where
it is: in no cache (after a 256 MiB read) or just read (warm). The overhead model prices every
byte a check reads at one rate, the scores' in no cache (``check_bandwidth``); this shows what
that one rate leaves out (docs/benchmarks.md).

    python -m tools.bench_reads --seq 512 --out docs/figures/reads_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from bench.timing import Timer
from megatron_abft.ops import compiled

FLUSH_BYTES = 256 * 2**20
SIZES_MIB = (0.5, 1, 2, 4, 8, 16, 32)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=512, help="sequence of the attention operands")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--block", type=int, default=256, help="checksum block length")
    p.add_argument("--sizes", type=float, nargs="+", default=SIZES_MIB, help="MiB, rows of 512")
    p.add_argument("--reps", type=int, default=21)
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    return p.parse_args(argv)


def read_seconds(matrix: torch.Tensor, block: int, reps: int, flush: torch.Tensor) -> dict:
    """Median seconds of the kernels' block sums over ``matrix`` (both sides), cold and warm."""
    times, timer = {"cold": [], "warm": []}, Timer.on(matrix.device)
    for _ in range(reps):
        flush.sum()
        for state in ("cold", "warm"):
            begin = timer.start()
            compiled.block_sums(matrix, block, block)
            times[state].append(timer.seconds(begin, timer.start()))
    return {state: statistics.median(t) for state, t in times.items()}


def attention_values(seq: int, hidden: int, heads: int) -> dict[str, torch.Tensor]:
    """V as the attention takes it, ``[b, np, s, hn]``: a view of the qkv projection's output
    ``[s, b, np, 3 hn]`` (Megatron's layout), the same values in ``[s, b, np, hn]``, and
    contiguous."""
    hn = hidden // heads
    mixed = torch.randn(seq, 1, heads, 3 * hn)
    own = mixed[..., 2 * hn :].contiguous()
    return {
        "V in the qkv output": mixed[..., 2 * hn :].permute(1, 2, 0, 3),
        "V in [s, b, np, hn]": own.permute(1, 2, 0, 3),
        "V contiguous": own.permute(1, 2, 0, 3).contiguous(),
    }


def measure(args) -> dict | None:
    """Each matrix's bytes and read times; None without the kernels."""
    if not compiled.available():
        return None
    flush = torch.ones(FLUSH_BYTES // 4)
    matrices = {
        f"{mib:g} MiB contiguous": torch.randn(max(1, round(mib * 2**20 / 4 / 512)), 512)
        for mib in args.sizes
    }
    matrices.update(attention_values(args.seq, args.hidden, args.heads))
    results = {}
    for name, matrix in matrices.items():
        seconds = read_seconds(matrix, args.block, args.reps, flush)
        results[name] = {"bytes": matrix.numel() * matrix.element_size(), **seconds}
    return {"args": {k: str(v) for k, v in vars(args).items()}, "reads": results}


def main() -> None:
    args = parse_args()
    result = measure(args)
    if result is None:
        raise SystemExit("bench_reads: the compiled kernels are not available")
    print(f"{'matrix':<22} {'MiB':>6} {'cold ms':>8} {'GB/s':>6} {'warm ms':>8} {'GB/s':>6}")
    for name, r in result["reads"].items():
        print(
            f"{name:<22} {r['bytes'] / 2**20:>6.2f} {r['cold'] * 1e3:>8.3f} "
            f"{r['bytes'] / r['cold'] / 1e9:>6.1f} {r['warm'] * 1e3:>8.3f} "
            f"{r['bytes'] / r['warm'] / 1e9:>6.1f}"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        print(f"results: {args.out}")
