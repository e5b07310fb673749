"""No false alarms on clean data: run the protected flash attention's kernels forward and
backward on realistic inputs until every dtype has checked at least ``--tiles`` tile GEMMs each
way, and record what the checks found (nothing, if the bounds hold) and the largest clean
residual of each section as a share of its bound (the margin).

    python -m tools.flash_false_alarms --tiles 5000 --json docs/figures/flash_false_alarms_cpu.json

On CPU tensors the kernels run in Triton's interpreter (IEEE fp32 arithmetic, as the bounds
assume); on a GPU (``--device cuda``) the same sweep measures the tensor cores' rounding, which
is what tools/gpu_check.sh runs.

The inputs (``KINDS``): standard normal; outlier rows and outlier channels scaled by 100;
an attention sink (every query's largest score on key 0); near-one-hot softmax (scores scaled
by 8), each causal and not.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

from megatron_abft.config import DTYPES, FLASH_SECTIONS
from megatron_abft.config import KINDS as ERROR_KINDS
from megatron_abft.flash import launch, tiles

OUTCOME = ("clean", "corrected", "uncorrectable")
"""The kernels' outcome codes (megatron_abft.flash.kernels)."""
KINDS = ("normal", "outlier_rows", "outlier_channels", "sink", "one_hot")


def cpu_name() -> str:
    """The CPU's model name (Linux), else the machine type."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def inputs(kind: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int, device: str):
    """q, k, v and an upstream gradient of one input kind (KINDS), ``shape`` [b, h, n, d]."""
    g = torch.Generator().manual_seed(seed)
    b, h, n, d = shape
    q, k, v, do = (torch.randn(b, h, n, d, generator=g) for _ in range(4))
    if kind == "outlier_rows":  # a few tokens 100x larger in q, k and v
        rows = torch.randint(0, n, (max(1, n // 32),), generator=g)
        for t in (q, k, v):
            t[:, :, rows] *= 100
    elif kind == "outlier_channels":  # a few head-dim channels 100x larger in q and k
        channels = torch.randint(0, d, (max(1, d // 16),), generator=g)
        q[..., channels] *= 100
        k[..., channels] *= 100
    elif kind == "sink":  # key 0 aligned with every query: the softmax piles onto it
        k[:, :, 0] = q.mean(2) * 4 * math.sqrt(d) / q.mean(2).norm(dim=-1, keepdim=True)
    elif kind == "one_hot":  # sharp scores: rows of P near one-hot
        q *= 8
    if dtype == torch.float16:  # fp16 holds outliers of 100 x N(0, 1); keep S finite
        q, k = q / 4, k / 4
    return [t.to(dtype).to(device) for t in (q, k, v, do)]


def tiles_checked(n: int, heads: int, batch: int, dim: int, dtype: torch.dtype, causal: bool):
    """Tile GEMMs the forward and the backward check for one call (the kernels' loops)."""
    width = tiles.padded_head_dim(dim)

    def pairs(rows: int, cols: int) -> int:  # (row block, column block) pairs computed
        count = 0
        for r0 in range(0, n, rows):
            hi = min(n, r0 + rows) if causal else n
            count += -(-hi // cols)
        return count

    fwd = launch.blocks("forward", width, dtype)
    dkdv = launch.blocks("dkdv", width, dtype)
    dq = launch.blocks("dq", width, dtype)
    matrices = batch * heads
    dkdv_pairs = 0
    for k0 in range(0, n, dkdv.block_n):  # a key block over its query blocks
        lo = (k0 // dkdv.block_m) * dkdv.block_m if causal else 0
        dkdv_pairs += -(-(n - lo) // dkdv.block_m)
    forward = 2 * pairs(fwd.block_m, fwd.block_n) * matrices
    backward = (4 * dkdv_pairs + 3 * pairs(dq.block_m, dq.block_n)) * matrices
    return forward, backward


def sweep(dtype_name: str, target: int, seq: int, device: str) -> dict:
    """Calls until ``target`` tile GEMMs each way are checked: what was flagged, and the
    largest clean ratio |residual| / (u * mass) per section (the bound is TILE_C of it: the
    flagged rows' ratios are in it too, so an alarm shows how far it went)."""
    dtype = DTYPES[dtype_name]
    shape = (1, 2, seq, 64)
    ratio = torch.zeros(len(FLASH_SECTIONS), dtype=torch.float64)
    flagged = torch.zeros(len(FLASH_SECTIONS), dtype=torch.int64)
    done = {"forward": 0, "backward": 0}
    calls, alarms, seed = [], [], 0
    by_inputs = {kind: torch.zeros_like(ratio) for kind in KINDS}
    tile_c = launch.TILE_C[dtype]
    checks = launch.Checks((1 << len(FLASH_SECTIONS)) - 1, tile_c * 2.0**-24, 1e10)
    while min(done.values()) < target:
        for kind in KINDS:
            for causal in (True, False):
                q, k, v, do = inputs(kind, shape, dtype, seed, device)
                found = launch.Findings.empty(shape[0] * shape[1], q.device, calibrate=True)
                o, lse = launch.forward(q, k, v, causal, shape[-1] ** -0.5, checks, found)
                launch.backward(do, q, k, v, o, lse, causal, shape[-1] ** -0.5, checks, found)
                call_ratio = found.ratio.double().amax(1).cpu()
                ratio = torch.maximum(ratio, call_ratio)
                by_inputs[kind] = torch.maximum(by_inputs[kind], call_ratio)
                codes = found.codes.cpu()
                flagged += (codes > 0).sum(1)
                if codes.any():  # where each alarm came from: the inputs and the fault kind
                    alarms.append(
                        {
                            "inputs": kind,
                            "causal": causal,
                            "seed": seed,
                            "sections": {
                                section: [
                                    f"{OUTCOME[c >> 2]} {ERROR_KINDS[c & 3]}"
                                    for c in row[row > 0].tolist()
                                ]
                                for section, row in zip(FLASH_SECTIONS, codes, strict=True)
                                if row.any()
                            },
                        }
                    )
                fwd, bwd = tiles_checked(seq, shape[1], shape[0], shape[3], dtype, causal)
                done["forward"] += fwd
                done["backward"] += bwd
                calls.append({"kind": kind, "causal": causal, "seed": seed})
                seed += 1
    return {
        "dtype": dtype_name,
        "tile_c": tile_c,
        "tiles": done,
        "calls": len(calls),
        "false_alarms": dict(zip(FLASH_SECTIONS, flagged.tolist(), strict=True)),
        "alarms": alarms,
        "largest_ratio": dict(zip(FLASH_SECTIONS, ratio.tolist(), strict=True)),
        "largest_ratio_by_inputs": {
            kind: dict(zip(FLASH_SECTIONS, r.tolist(), strict=True))
            for kind, r in by_inputs.items()
        },
        "margin": {
            s: (tile_c / r if r > 0 else None)
            for s, r in zip(FLASH_SECTIONS, ratio.tolist(), strict=True)
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiles", type=int, default=5000, help="tile GEMMs each way, a dtype")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    results = [sweep(d, args.tiles, args.seq, args.device) for d in args.dtypes]
    report = {
        "command": " ".join(["python", "-m", "tools.flash_false_alarms", *sys.argv[1:]]),
        "device": (
            torch.cuda.get_device_name()
            if args.device.startswith("cuda")
            else f"CPU ({cpu_name()}), Triton interpreter"
        ),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "seconds": round(time.perf_counter() - start, 1),
        "results": results,
    }
    print("| dtype | tiles fwd | tiles bwd | false alarms | smallest margin (section) |")
    print("|---|---|---|---|---|")
    for r in results:
        margins = {s: m for s, m in r["margin"].items() if m is not None}
        worst = min(margins, key=margins.get) if margins else None
        print(
            f"| {r['dtype']} | {r['tiles']['forward']} | {r['tiles']['backward']} | "
            f"{sum(r['false_alarms'].values())} | "
            + (f"{margins[worst]:.0f}x ({worst}) |" if worst else "- |")
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 1 if any(sum(r["false_alarms"].values()) for r in results) else 0
