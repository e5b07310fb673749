"""No false alarms in the unfused path's checked GEMMs: compute each attention GEMM of a model
(qkv, scores, context, proj) on clean inputs, check it the way the protected layers do, and
record what the checks found (nothing, if the bounds hold) and the largest clean residual as a
share of its threshold (the margin is its inverse).

    python -m tools.gemm_false_alarms --device cuda --json out/gemm_false_alarms.json

On a GPU the GEMMs run on the tensor cores (cuBLAS), so the residuals measure their rounding
against the bounds of megatron_abft.check.tolerance; ``tf32`` is fp32 with TF32 matmuls allowed. The
shapes are one micro-batch of a layer of the model (default GPT-3 350M: hidden 1024, 16 heads,
sequence 2048). The inputs (``KINDS_OF_INPUT``): standard normal; outlier rows and outlier
channels scaled by 100; LLM-like activations (heavy-tailed, a few massive channels, layer-normed)
with an attention sink in the scores. fp16's Q and K are scaled by 1/4, so that the scores fit
its range; a product that still overflows is counted apart (``overflowed_repeats``): a check
rightly flags its infinities.

``--checked-gemm`` also runs the projections (qkv, proj) through the checked GEMM
(megatron_abft.ops.checked_gemm; bf16 and fp16 on a GPU), which keeps no residuals: it records
the tiles flagged at the bound and the smallest of SCALES at which none is (the margin is at
least its inverse).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from functools import partial
from pathlib import Path

import torch

from megatron_abft.check.checksum import GemmOperands, encode
from megatron_abft.check.eec import report, residuals, verify_and_correct
from megatron_abft.config import FORWARD_SECTIONS, KINDS
from megatron_abft.ops import checked_gemm, compiled

KINDS_OF_INPUT = ("normal", "outlier_rows", "outlier_channels", "llm_like")
SCALES = (1.0, 2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-10)
"""The checked GEMM's threshold scales, tried from the bound down."""
PRECISIONS = {
    "bf16": (torch.bfloat16, False),
    "fp16": (torch.float16, False),
    "fp32": (torch.float32, False),
    "tf32": (torch.float32, True),
}


def activations(tokens: int, width: int, kind: str, g: torch.Generator) -> torch.Tensor:
    """``[tokens, width]`` fp32 inputs of the given kind, on ``g``'s device."""
    device = g.device
    x = torch.randn(tokens, width, generator=g, device=device)
    if kind == "outlier_rows":
        x[torch.randperm(tokens, generator=g, device=device)[: max(1, tokens // 64)]] *= 100
    elif kind == "outlier_channels":
        x[:, torch.randperm(width, generator=g, device=device)[: max(1, width // 64)]] *= 100
    elif kind == "llm_like":  # Student's t with 3 degrees of freedom: heavy tails
        chi2 = torch.randn(3, tokens, width, generator=g, device=device).square().sum(0)
        x = x / (chi2 / 3).sqrt()
        x[:, torch.randperm(width, generator=g, device=device)[:4]] *= 50  # massive activations
        x = torch.nn.functional.layer_norm(x, (width,))
    return x


def operands(section: str, kind: str, args, g: torch.Generator, dtype: torch.dtype):
    """(a, b, alpha, bias) of one section's GEMM for ``dtype``, fp32 on ``g``'s device."""
    hidden, heads, seq = args.hidden, args.heads, args.seq
    dim = hidden // heads
    if section in ("qkv", "proj"):
        out = 3 * hidden if section == "qkv" else hidden
        a = activations(seq, hidden, kind, g)
        w = torch.randn(hidden, out, generator=g, device=g.device) * 0.02
        return a, w, 1.0, torch.randn(out, generator=g, device=g.device) * 0.02
    q = activations(heads * seq, dim, kind, g).view(heads, seq, dim)
    k = activations(heads * seq, dim, kind, g).view(heads, seq, dim)
    if kind == "llm_like":
        k[:, 0] = q.mean(1) * 8  # an attention sink: every query's largest score on key 0
    if dtype == torch.float16:  # fp16 holds outliers of 100 x N(0, 1); keep S finite
        q, k = q / 4, k / 4
    alpha = dim**-0.5
    if section == "scores":
        return q, k.mT, alpha, None
    scores = alpha * q @ k.mT
    causal = torch.ones(seq, seq, dtype=torch.bool, device=g.device).triu(1)
    probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
    v = activations(heads * seq, dim, kind, g).view(heads, seq, dim)
    return probs, v, 1.0, None


def sweep(args, device: torch.device) -> list[dict]:
    rows = []
    for precision in args.dtypes:
        dtype, tf32 = PRECISIONS[precision]
        torch.backends.cuda.matmul.allow_tf32 = tf32
        for section in FORWARD_SECTIONS:
            for kind in KINDS_OF_INPUT:
                worst, flagged, detected, checked, overflowed = 0.0, 0, 0, 0, 0
                fused_alarms, fused_clean = 0, 0.0
                for repeat in range(args.repeats):
                    g = torch.Generator(device).manual_seed(repeat)
                    a, b, alpha, bias = operands(section, kind, args, g, dtype)
                    a, b = a.to(device, dtype), b.to(device, dtype)
                    bias = None if bias is None else bias.to(device, dtype)
                    if alpha != 1.0:  # in the GEMM, before rounding, as Megatron's baddbmm
                        c = torch.baddbmm(a.new_empty(()), a, b, beta=0.0, alpha=alpha)
                    else:
                        c = a @ b
                    c = c if bias is None else c + bias
                    if not torch.isfinite(c).all():  # the true product is out of range: a
                        overflowed += 1  # check rightly flags it, so it is no false alarm
                        continue
                    col, row = encode(a, b, alpha=alpha, bias=bias, block=args.block)
                    for side, ref in (("col", col), ("row", row)):
                        found = residuals(c, ref, side=side)
                        share = torch.maximum(
                            found.d1.abs() / found.tau, found.d2.abs() / found.tau_w
                        )
                        worst = max(worst, float(share.max()))
                        flagged += int(found.flagged.sum())
                    result = verify_and_correct(
                        c.clone(),
                        col,
                        row,
                        operands=GemmOperands(a, b, alpha, bias),
                        sync_free=False,
                    )
                    detected += sum(report(result)["detected"].values())
                    checked += c.shape[0] if c.dim() == 3 else 1
                    if args.checked_gemm:
                        gemm = checked_gemm_alarms(a, b, alpha, bias)
                        fused_alarms += gemm[0]
                        fused_clean = max(fused_clean, gemm[1])
                extra = {}
                if args.checked_gemm:
                    extra = {
                        "checked_gemm_tiles_flagged": fused_alarms,
                        "checked_gemm_clean_scale": fused_clean,
                    }
                    detected += fused_alarms
                rows.append(
                    dict(
                        precision=precision,
                        section=section,
                        inputs=kind,
                        matrices=checked,
                        worst_share_of_threshold=worst,
                        flagged_vectors=flagged,
                        detected=detected,
                        overflowed_repeats=overflowed,
                        **extra,
                    )
                )
                print(
                    f"{precision:>5} {section:>8} {kind:>17} {checked:>5} matrices  worst "
                    f"{worst:.3g} of the threshold  flagged {flagged}  detected {detected}"
                    + (f"  ({overflowed} repeats overflowed)" if overflowed else "")
                    + (
                        f"  checked GEMM: {fused_alarms} tiles flagged, none at {fused_clean:g} "
                        "of the bound"
                        if extra
                        else ""
                    ),
                    flush=True,
                )
    return rows


def checked_gemm_alarms(a, b, alpha, bias) -> tuple[int, float]:
    """The checked GEMM on ``alpha a @ b + bias`` (a projection's, or the attention's batch of
    heads): tiles flagged at its bound, and the smallest of SCALES (from 1 down) at which none
    is (inf where one is at the bound)."""
    block_n = checked_gemm.tiles_for(a.device).block_n
    if a.dim() == 3:  # [heads, m, k] @ [heads, k, n]: one sample of checked_matmul's batch
        x, w = a[None], b.mT[None]
        gemm = partial(checked_gemm.checked_matmul, x, w, alpha=alpha)
    else:
        x, w = a, b.t().contiguous()
        gemm = partial(checked_gemm.checked_linear, x, w, bias)
    sums = checked_gemm.weight_sums(w, block_n)
    at_bound, clean = 0, float("inf")
    for scale in SCALES:
        _, codes = gemm(sums=sums, threshold_scale=scale)
        flagged = int(codes.count_nonzero())
        if scale == 1.0:
            at_bound = flagged
        if flagged:
            break
        clean = scale
    return at_bound, clean


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--block", type=int, default=256, help="checksum block length")
    parser.add_argument("--repeats", type=int, default=4, help="fresh inputs per case")
    parser.add_argument("--dtypes", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--no-reduced-precision-reductions",
        dest="reduced",
        action="store_false",
        help="CUDA: turn off torch's fp16/bf16 reduced-precision reductions, which the thresholds "
        "then no longer allow for (megatron_abft.check.tolerance.gemm_rounding): far tighter "
        "bounds",
    )
    parser.add_argument(
        "--checked-gemm",
        action="store_true",
        help="also each GEMM through the checked GEMM (bf16 and fp16; on a GPU)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.checked_gemm and not set(args.dtypes) <= {"bf16", "fp16"}:
        parser.error("--checked-gemm takes --dtypes bf16 and/or fp16 (the kernel's on a GPU)")
    device = torch.device(args.device)
    matmul = torch.backends.cuda.matmul
    matmul.allow_fp16_reduced_precision_reduction = args.reduced
    matmul.allow_bf16_reduced_precision_reduction = args.reduced
    begin = time.perf_counter()
    rows = sweep(args, device)
    alarms = sum(r["detected"] + r["flagged_vectors"] for r in rows)
    worst = max(r["worst_share_of_threshold"] for r in rows)
    print(f"false alarms: {alarms}; the worst clean residual is {worst:.3g} of its threshold")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        cuda = device.type == "cuda"
        record = {
            "command": " ".join(["python", *sys.argv]),
            "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "backend": compiled.backend(),
            "reduced_precision_reductions": args.reduced,
            "kinds": list(KINDS),
            "seconds": time.perf_counter() - begin,
            "false_alarms": alarms,
            "rows": rows,
        }
        args.json.write_text(json.dumps(record, indent=1) + "\n")
