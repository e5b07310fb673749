"""Time the compiled checksum kernels against the PyTorch path, on the attention scores' GEMM.

    python tools/bench_kernels.py [--batch 2] [--heads 8] [--seq 1024] [--head-dim 64]
                                  [--dtype bf16] [--block 256] [--device cpu] [--threads N]

For S = Q K^T / sqrt(d) it times the GEMM itself, the encoding of both sides' checksums, the
recomputed sums of both sides (one read of S through the kernels) and a whole clean
verify_and_correct, each through the extension and through the PyTorch path (the reference).
Runs of the two paths alternate, and each line reports the median.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from megatron_abft import _ext
from megatron_abft.checksum import encode
from megatron_abft.eec import _block_sums, verify_and_correct

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2, help="micro-batch size")
    parser.add_argument("--heads", type=int, default=8, help="attention heads")
    parser.add_argument("--seq", type=int, default=1024, help="sequence length")
    parser.add_argument("--head-dim", type=int, default=64, help="head dimension")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--block", type=int, default=256, help="checksum block length")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--repeat", type=int, default=15, help="timed runs per path")
    return parser.parse_args()


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Milliseconds for one call (the device synchronised before and after)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


def compare(fn: Callable[[], object], device: torch.device, repeat: int) -> tuple[float, float]:
    """Median ms through the extension and through the PyTorch path, runs interleaved."""
    fused, reference = [], []
    for run in range(repeat + 1):  # the first run of each path warms up
        f = timed(fn, device)
        with _ext.disabled():
            r = timed(fn, device)
        if run:
            fused.append(f)
            reference.append(r)
    return statistics.median(fused), statistics.median(reference)


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    g = torch.Generator().manual_seed(0)
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    q = torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
    scale = args.head_dim**-0.5
    scores = q @ k.mT * scale
    col, row = encode(q, k.mT, alpha=scale, block=args.block)
    refs = {"col": col, "row": row}
    gemm = statistics.median(timed(lambda: q @ k.mT, device) for _ in range(args.repeat))

    print(
        f"S = Q K^T / sqrt(d): {args.batch}x{args.heads} matrices of {args.seq}x{args.seq}, "
        f"d = {args.head_dim}, {args.dtype} on {device} ({torch.get_num_threads()} threads), "
        f"blocks of {args.block}; extension: {_ext.backend()}"
    )
    print(f"{'step':<34} {'kernels ms':>11} {'torch ms':>9} {'speed-up':>9} {'x GEMM':>7}")
    print(f"{'the GEMM Q K^T':<34} {gemm:>11.2f} {gemm:>9.2f} {'':>9} {1:>7.2f}")
    steps = {
        "encode both sides": lambda: encode(q, k.mT, alpha=scale, block=args.block),
        "sums of both sides (one read of S)": lambda: _block_sums(scores, refs),
        "verify_and_correct, clean": lambda: verify_and_correct(
            scores, col, row, check_references=False
        ),
    }
    for name, fn in steps.items():
        fused, reference = compare(fn, device, args.repeat)
        print(
            f"{name:<34} {fused:>11.2f} {reference:>9.2f} {reference / fused:>8.1f}x "
            f"{fused / gemm:>7.2f}"
        )


if __name__ == "__main__":
    main()
