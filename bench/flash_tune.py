"""The flash kernels' tiles, timed on a GPU: for each kernel and head dim, a short list of tile
shapes that pass the static gate (tools/flash_sass.py builds them), each timed in the protected
attention's forward and backward at GPT-3 350M's and Llama-2 7B's heads (bf16, causal, every
section checked) at 8192 tokens, where the kernels, not the host's launches, bound the call.
Writes the tuning file the launch reads (megatron_abft/flash/launch.TUNED, by device name;
``ABFT_FLASH_TILES`` names another):

    python -m tools.flash_tune --out megatron_abft/flash/tuned_tiles.json   # on a GPU, < 5 min

A kernel's candidates are timed with the others at their current tiles, in rounds (each round
times every candidate once, in turn), and the first listed is the gate's (tiles.TILES): another
replaces it only where its slowest round beats the gate's fastest by a margin (``choose``), so
that the file changes a kernel's tiles only for a win larger than the timings' spread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from megatron_abft.flash import flash_attention, tiles
from megatron_abft.flash.tiles import Blocks

CANDIDATES: dict[tuple[str, int], list[Blocks]] = {
    ("forward", 64): [Blocks(128, 64, 8, 2), Blocks(128, 128, 8, 3), Blocks(64, 64, 4, 2)],
    ("forward", 128): [Blocks(128, 64, 8, 2), Blocks(64, 64, 4, 2)],
    ("dkdv", 64): [Blocks(64, 128, 8, 3), Blocks(64, 64, 4, 2), Blocks(32, 128, 8, 2)],
    ("dkdv", 128): [Blocks(32, 64, 4, 2)],
    ("dq", 64): [Blocks(128, 64, 8, 2), Blocks(64, 64, 4, 2)],
    ("dq", 128): [Blocks(128, 64, 8, 2), Blocks(128, 32, 8, 2)],
}
"""Besides tiles.TILES: shapes that passed the static gate for bf16 when TILES were chosen;
each is built again before it is timed, and skipped where it spills or leaves wgmma."""
SHAPES = {64: (1, 16, 8192, 64), 128: (2, 16, 8192, 128)}
"""(batch, heads, seq, head dim): GPT-3 350M's and Llama-2 7B's (TP 2) attention. At 2048
tokens the call took what its host took to launch it (docs/benchmarks.md), and the sweep timed
the host: the same tiles 2.21 ms in one sweep and 2.64 in the next."""
MARGIN = 0.02
"""How much faster than the gate's fastest round a candidate's slowest must be to replace it."""


def choose(samples: dict[Blocks, list[float]], incumbent: Blocks, margin: float = MARGIN) -> Blocks:
    """The tiles to keep, from each candidate's timings (ms, one a round): the candidate with the
    lowest median where its slowest round is faster than the incumbent's fastest by ``margin``,
    else the incumbent (where it has no timings, the fastest median)."""
    timed = {c: times for c, times in samples.items() if times}
    if not timed:
        return incumbent
    if incumbent not in timed:
        return min(timed, key=lambda c: statistics.median(timed[c]))
    floor = min(timed[incumbent]) * (1 - margin)
    winners = [c for c, times in timed.items() if c != incumbent and max(times) < floor]
    if not winners:
        return incumbent
    return min(winners, key=lambda c: statistics.median(timed[c]))


def passes_the_gate(kernel: str, width: int) -> list[str]:
    """What keeps the kernel at its current tiles out of the gate (bf16, causal, checked and
    not, sm_90): spills, serialised wgmma, main-loop GEMMs not on wgmma."""
    from megatron_abft.dev import aot

    cases = [aot.Case("bfloat16", width, True, variant) for variant in ("checked", "unchecked")]
    jobs = [
        (case, made, 90)
        for case, made in aot.launches(cases)
        if made.kernel == kernel and not made.get("RETRY")
    ]
    builds = aot.build_all(jobs, workers=0)
    failing = [
        line for line in aot.verdicts(builds) if "budget" not in line and "allowed" not in line
    ]
    return [line for line in failing if "CTAs" not in line]


def time_call(head_dim: int, repeats: int) -> float:
    """Median ms of the protected attention's forward and backward."""
    import triton.testing

    batch, heads, seq, dim = SHAPES[head_dim]
    q, k, v = (
        torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16).requires_grad_()
        for _ in range(3)
    )
    grad = torch.randn_like(q)

    def call():
        flash_attention(q, k, v, causal=True).backward(grad)

    return triton.testing.do_bench(call, warmup=3, rep=repeats)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out/flash_tiles.json"))
    parser.add_argument("--repeats", type=int, default=100, help="ms of timing a candidate")
    parser.add_argument("--rounds", type=int, default=3, help="timings of each candidate")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("the tiles are timed on a GPU")
    if args.rounds < 1 or args.repeats < 1:
        parser.error("--rounds and --repeats must be at least 1")
    start = time.perf_counter()
    device = torch.cuda.get_device_name()
    chosen, timings = {}, {}
    for (kernel, width), others in CANDIDATES.items():
        incumbent = tiles.TILES[kernel, width]
        gated = []
        for candidate in [incumbent, *others]:
            tiles.TILES[kernel, width] = candidate
            failing = passes_the_gate(kernel, width)
            if failing:
                print(kernel, width, candidate, "skipped:", *failing)
            else:
                gated.append(candidate)
        samples: dict[Blocks, list[float]] = {c: [] for c in gated}
        failed: set[Blocks] = set()
        for turn in range(args.rounds if gated else 0):  # each round in another order
            for candidate in gated[turn % len(gated) :] + gated[: turn % len(gated)]:
                if candidate in failed:
                    continue
                tiles.TILES[kernel, width] = candidate
                try:
                    samples[candidate].append(time_call(width, args.repeats))
                except Exception as error:  # a candidate that fails to launch is dropped
                    print(kernel, width, candidate, "failed:", error)
                    failed.add(candidate)
                    samples[candidate].clear()
        for candidate, times in samples.items():
            if times:
                timings[f"{kernel}/{width}/{candidate}"] = times
                print(f"{kernel} {width} {candidate}: {times} ms", flush=True)
        best = choose(samples, incumbent)
        tiles.TILES[kernel, width] = best
        chosen[f"{kernel}/{width}"] = [
            best.block_m,
            best.block_n,
            best.num_warps,
            best.num_stages,
            best.maxnreg,
        ]
    table = json.loads(args.out.read_text()) if args.out.exists() else {}
    table[device] = chosen
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(table, indent=1) + "\n")
    report = {"device": device, "seconds": round(time.perf_counter() - start), "ms": timings}
    args.out.with_suffix(".timings.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0
