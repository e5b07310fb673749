"""The flash kernels' static speed gate, as a report: every production kernel built for sm_90 as
the launcher runs it (megatron_abft.dev.aot), with what its SASS says about its main loop, and
what fails the gate (tests/flash/test_flash_gate.py fails on the same).

    python -m tools.flash_sass --markdown                      # the table for docs/benchmarks.md
    python -m tools.flash_sass --all --json out/flash_sass.json
    python -m tools.flash_sass --running                       # the launches with running sums

``--all`` also builds what must build without a budget: the second (RETRY) launches, fault
injection and calibration, grouped-query attention, ragged lengths, a padded head dim, and
sm_80. No GPU is needed: Triton compiles for a GPUTarget and ptxas and cuobjdump ship with it.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from megatron_abft.dev import aot
from megatron_abft.flash import checksums, tiles


def jobs(dtypes: list[str], all_builds: bool) -> list[tuple]:
    """(case, launch, arch) for the production kernels, and with ``all_builds`` everything else
    the flash path launches."""
    cases = [c for c in aot.production_cases() if c.dtype in dtypes]
    if all_builds:
        cases += aot.other_cases()
    made = []
    for case, launched in aot.launches(cases):
        attention = launched.kernel in tiles.KERNELS
        if all_builds or (attention and not launched.get("RETRY")):
            made.append((case, launched, 90))
    if all_builds:
        production = [c for c in cases if c.variant in ("checked", "unchecked")]
        made += [(case, launched, 80) for case, launched in aot.launches(production, 80)]
    return made


def running_markdown(builds: list[aot.Build], seqs: tuple[int, ...] = (2048, 8192)) -> str:
    """The launches that add up running sums: what a step of their scan costs, and how many
    dependent steps a head takes at ``seqs`` tokens (a program a head walks its tiles in
    steps)."""
    lines = [
        "| launch | dtype | head dim | tile rows | regs | spills (B) | tiles a step "
        "| instructions, barriers a step | steps a head at " + " / ".join(map(str, seqs)) + " |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for b in sorted(builds, key=lambda b: (b.kernel, b.case.dtype, b.case.head_dim)):
        get = b.launch.get
        step = checksums.SCAN.value // get("HEAD_DIM")
        instructions, barriers = b.extra["loops"][0]  # the prefix sums' loop comes first
        steps = " / ".join(str(math.ceil(math.ceil(seq / get("BLOCK")) / step)) for seq in seqs)
        lines.append(
            f"| {b.kernel} | {b.case.dtype} | {b.case.head_dim} | {get('BLOCK')} | {b.registers} "
            f"| {b.spills} | {step} | {instructions}, {barriers} | {steps} |"
        )
    return "\n".join(lines)


def markdown(builds: list[aot.Build]) -> str:
    """Checked against unchecked, a row per kernel, head dim, dtype and mask (sm_90)."""
    pairs: dict[tuple, dict] = {}
    for b in builds:
        if b.arch != 90 or b.kernel not in tiles.KERNELS or b.launch.get("RETRY"):
            continue
        if b.case.variant not in ("checked", "unchecked"):
            continue
        key = (b.kernel, b.case.head_dim, b.case.dtype, b.case.causal)
        pairs.setdefault(key, {})[b.case.variant] = b
    lines = [
        "| kernel | head dim | dtype | mask | tile (m, n, warps, stages) | MMA in the loop "
        "| regs u/c | CTA/SM u/c | slots/elem u/c (budget) | BAR u/c | SHFL u/c "
        "| wgmma waits u/c |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (kernel, width, dtype, causal), pair in sorted(pairs.items()):
        u, c = pair.get("unchecked"), pair.get("checked")
        if u is None or c is None or u.loop is None or c.loop is None:
            continue
        get = u.launch.get
        tile = f"{get('BLOCK_M')}, {get('BLOCK_N')}, {get('num_warps')}, {get('num_stages')}"
        mma = ", ".join(
            f"{op.split('.')[0]} {op.split('.')[1]} x{n}" for op, n in c.loop.mma.items()
        )
        budget = tiles.BUDGETS[kernel, width]
        lines.append(
            f"| {kernel} | {width} | {dtype} | {'causal' if causal else 'full'} | {tile} | {mma} "
            f"| {u.registers}/{c.registers} | {u.ctas_per_sm}/{c.ctas_per_sm} "
            f"| {u.loop.slots_per_element}/{c.loop.slots_per_element} "
            f"({budget.slots}/+{budget.checked}) | {u.loop.barriers}/{c.loop.barriers} "
            f"| {u.loop.shuffles}/{c.loop.shuffles} | {u.loop.wgmma_waits}/{c.loop.wgmma_waits} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"])
    parser.add_argument("--all", action="store_true", help="every build, not only the gated")
    parser.add_argument("--workers", type=int, default=0, help="processes (0: one a CPU)")
    parser.add_argument("--json", type=Path, help="write every build here")
    parser.add_argument("--markdown", action="store_true", help="print the table for the docs")
    parser.add_argument(
        "--running",
        action="store_true",
        help="only the launches that add up column sums over a head's tiles, and their table",
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.running:
        running = aot.running_launches(tuple(args.dtypes))
        builds = aot.build_all([(c, made, 90) for c, made in running], workers=args.workers)
        failed = aot.verdicts(builds)
        print(f"{len(builds)} builds, {len(failed)} failing")
        for line in failed:
            print("  " + line)
        print(running_markdown(builds))
        return 1 if failed else 0
    builds = aot.build_all(jobs(args.dtypes, args.all), workers=args.workers)
    failed = aot.verdicts(builds)
    print(f"{len(builds)} builds in {time.perf_counter() - start:.0f} s, {len(failed)} failing")
    for line in failed:
        print("  " + line)
    if args.markdown:
        print(markdown(builds))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([b.as_dict() for b in builds], indent=1, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
