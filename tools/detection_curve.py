"""Detection limit of EEC-ABFT: how small a finite error it still detects, per dtype.

For each dtype, a batch of attention-score-shaped GEMMs S = Q K^T / sqrt(d) gets one finite error
per matrix, of magnitude r * rms(S) with a random sign at a random element; the curve is the
fraction detected, and the fraction corrected to within 2x torch's own error against an fp64
reference (FlashAttention's rule), against r. The
detection limit is the smallest r detected in at least 99% of the trials.

    python -m tools.detection_curve --out docs/figures/detection_curve.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from megatron_abft import CLEAN, CORRECTED, GemmOperands, encode, verify_and_correct
from megatron_abft.config import DTYPES


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=512, help="sequence length (S is seq x seq)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block", type=int, default=256, help="checksum block length")
    parser.add_argument("--trials", type=int, default=200, help="faulty matrices per point")
    parser.add_argument("--points", type=int, default=25, help="error magnitudes per dtype")
    parser.add_argument("--lowest", type=float, default=1e-3, help="smallest r = |error|/rms(S)")
    parser.add_argument("--highest", type=float, default=1e2, help="largest r")
    parser.add_argument("--dtypes", default="fp32,bf16,fp16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("out/detection_curve.png"))
    return parser.parse_args()


def measure(dtype: torch.dtype, ratios: torch.Tensor, args: argparse.Namespace) -> dict:
    g = torch.Generator().manual_seed(args.seed)
    shape = (args.trials, args.seq, args.head_dim)
    q = torch.randn(*shape, generator=g).to(dtype)
    k = torch.randn(*shape, generator=g).to(dtype)
    scale = args.head_dim**-0.5
    clean = (q @ k.mT * scale).to(dtype)
    exact = q.double() @ k.double().mT * scale
    allowed = 2 * (clean.double() - exact).abs().amax((1, 2))  # FlashAttention's rule
    col, row = encode(q, k.mT, alpha=scale, block=args.block)
    operands = GemmOperands(q, k.mT, scale)
    rms = clean.float().pow(2).mean().sqrt().item()
    rows = torch.randint(args.seq, (args.trials,), generator=g)
    cols = torch.randint(args.seq, (args.trials,), generator=g)
    signs = torch.randint(2, (args.trials,), generator=g) * 2 - 1
    batch = torch.arange(args.trials)
    detected, corrected = [], []
    for r in ratios.tolist():
        s = clean.clone()
        s[batch, rows, cols] = (s[batch, rows, cols].float() + signs * r * rms).to(dtype)
        status = verify_and_correct(s, col, row, operands=operands).status
        accurate = (s.double() - exact).abs().amax((1, 2)) <= allowed
        detected.append((status != CLEAN).float().mean().item())
        corrected.append(((status == CORRECTED) & accurate).float().mean().item())
    limit = next((r for r, d in zip(ratios.tolist(), detected, strict=True) if d >= 0.99), None)
    return {"rms": rms, "detected": detected, "corrected": corrected, "limit": limit}


def plot(ratios: torch.Tensor, results: dict, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for (name, res), color in zip(results.items(), ("C0", "C1", "C2"), strict=False):
        ax.semilogx(ratios, res["detected"], color=color, label=f"{name} detected")
        ax.semilogx(
            ratios, res["corrected"], color=color, linestyle="--", label=f"{name} corrected"
        )
    ax.axhline(0.99, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xlabel("|injected error| / rms(S)")
    ax.set_ylabel("fraction of trials")
    ax.set_title(
        f"EEC-ABFT detection limit: S = QK^T, {args.seq}x{args.seq}, d={args.head_dim}, "
        f"block {args.block}"
    )
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, which="both", alpha=0.3)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


def main() -> None:
    args = parse_args()
    ratios = torch.logspace(
        torch.log10(torch.tensor(args.lowest)), torch.log10(torch.tensor(args.highest)), args.points
    )
    results = {name: measure(DTYPES[name], ratios, args) for name in args.dtypes.split(",")}
    plot(ratios, results, args)
    args.out.with_suffix(".json").write_text(
        json.dumps(
            {
                "ratios": ratios.tolist(),
                "args": vars(args) | {"out": str(args.out)},
                "results": results,
            },
            indent=1,
        )
    )
    print(f"{'dtype':<6} {'rms(S)':>8} {'99% detection limit (|error|/rms)':>36}")
    for name, res in results.items():
        limit = f"{res['limit']:.3g}" if res["limit"] is not None else "beyond the sweep"
        print(f"{name:<6} {res['rms']:>8.3f} {limit:>36}")
    print(f"plot: {args.out}  data: {args.out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
