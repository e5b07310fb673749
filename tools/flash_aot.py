"""Build every flash kernel configuration for sm_80 and sm_90 without a GPU and report what each
uses (shared memory, registers, spills): ``megatron_abft.flash.aot``. CI runs the same builds
(tests/flash/test_flash_aot.py); this writes them down for docs/benchmarks.md.

    python -m tools.flash_aot --json docs/figures/flash_aot.json --markdown
    python -m tools.flash_aot --from-json docs/figures/flash_aot.json   # the tables again

``--search`` picks the tile shapes launch.TILES holds: for each kernel, head width and dtype,
the first candidate (largest tiles first) whose every variant builds without spills for both
architectures.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from megatron_abft.flash import aot, launch

CANDIDATES: dict[str, list[launch.Blocks]] = {
    "forward": [
        launch.Blocks(128, 64, 8, 2),
        launch.Blocks(64, 64, 4, 2),
        launch.Blocks(64, 64, 8, 2),
        launch.Blocks(128, 32, 8, 2),
        launch.Blocks(64, 32, 4, 2),
        launch.Blocks(32, 32, 4, 2),
        launch.Blocks(32, 16, 4, 1),
        launch.Blocks(16, 16, 4, 1),
        launch.Blocks(16, 16, 1, 1),
    ],
    "dkdv": [
        launch.Blocks(64, 64, 8, 2),
        launch.Blocks(32, 64, 4, 2),
        launch.Blocks(32, 64, 8, 2),
        launch.Blocks(32, 32, 4, 2),
        launch.Blocks(32, 32, 8, 2),
        launch.Blocks(16, 32, 4, 1),
        launch.Blocks(16, 16, 4, 1),
        launch.Blocks(16, 16, 1, 1),
    ],
    "dq": [
        launch.Blocks(128, 32, 8, 2),
        launch.Blocks(64, 64, 8, 2),
        launch.Blocks(64, 32, 4, 2),
        launch.Blocks(64, 32, 8, 2),
        launch.Blocks(64, 16, 8, 2),
        launch.Blocks(32, 32, 4, 2),
        launch.Blocks(32, 16, 4, 1),
        launch.Blocks(16, 16, 4, 1),
        launch.Blocks(16, 16, 1, 1),
    ],
}


def search(workers: int) -> dict[tuple[str, int, str], launch.Blocks | None]:
    """The first candidate of each (kernel, width, dtype) whose every variant, causal or not,
    builds for every architecture without a problem (None: none does)."""
    chosen = {}
    for kernel in launch.KERNELS:
        for width in launch.HEAD_DIMS:
            for dtype in launch.GPU_DTYPES:
                name = str(dtype).removeprefix("torch.")
                for blocks in CANDIDATES[kernel]:
                    configs = [
                        aot.Config(kernel, name, width, causal, variant, blocks)
                        for causal in (False, True)
                        for variant in aot.VARIANTS
                    ]
                    builds = aot.build_all(configs, workers=workers)
                    worst = max(builds, key=lambda b: (b.stack + b.local, b.registers))
                    print(
                        kernel,
                        width,
                        name,
                        blocks,
                        "->",
                        worst.registers,
                        worst.stack,
                        worst.problems,
                        flush=True,
                    )
                    if not any(b.problems for b in builds):
                        chosen[kernel, width, name] = blocks
                        break
                else:
                    chosen[kernel, width, name] = None
    return chosen


def markdown(builds: list[aot.Build]) -> str:
    """Two tables: per kernel, head width and dtype, its tile and the most shared memory and
    registers any of its variants (causal or not) uses on each architecture; and per attention
    kernel and width, the registers of the checked and the unchecked variants on sm_90."""
    rows: dict[tuple, dict] = {}
    pair: dict[tuple, int] = {}
    for b in builds:
        c = b.config
        row = rows.setdefault((c.kernel, c.head_dim, c.dtype), {"blocks": c.blocks})
        shared, registers = row.get(b.arch, (0, 0))
        row[b.arch] = (max(shared, b.shared), max(registers, b.registers))
        if c.variant in ("checked", "unchecked") and c.kernel in launch.KERNELS and b.arch == 90:
            key = (c.kernel, c.head_dim, c.variant)
            pair[key] = max(pair.get(key, 0), b.registers)
    lines = [
        "| kernel | head dim | dtype | tile (m, n, warps, stages) "
        "| sm_80 smem KiB / regs | sm_90 smem KiB / regs |",
        "|---|---|---|---|---|---|",
    ]
    for (kernel, width, dtype), row in rows.items():
        b = row["blocks"]
        cells = [f"{row[a][0] / 1024:.0f} / {row[a][1]}" if a in row else "-" for a in aot.ARCHS]
        tile = "-" if kernel in aot.HELPERS else f"{b.block_m}, {b.block_n}, {b.num_warps}, "
        tile += "" if kernel in aot.HELPERS else f"{b.num_stages}"
        lines.append(
            f"| {kernel} | {width or '-'} | {dtype} | {tile} | " + " | ".join(cells) + " |"
        )
    lines += ["", "| kernel | head dim | checked | checks compiled out |", "|---|---|---|---|"]
    for kernel in launch.KERNELS:
        for width in launch.HEAD_DIMS:
            checked, unchecked = (pair[kernel, width, v] for v in ("checked", "unchecked"))
            lines.append(f"| {kernel} | {width} | {checked} | {unchecked} |")
    return "\n".join(lines)


def load(path: Path) -> list[aot.Build]:
    """The builds a ``--json`` file holds."""
    builds = []
    for r in json.loads(path.read_text()):
        c = dict(r["config"])
        c["tiles"] = launch.Blocks(**c["tiles"]) if c["tiles"] else None
        c["options"] = tuple(tuple(option) for option in c["options"])
        fields = ("shared", "registers", "stack", "local", "seconds")
        builds.append(aot.Build(aot.Config(**c), r["arch"], *(r[f] for f in fields)))
    return builds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write every build here")
    parser.add_argument("--markdown", action="store_true", help="print the table for the docs")
    parser.add_argument("--search", action="store_true", help="pick the tile shapes")
    parser.add_argument("--from-json", type=Path, help="print the tables of a --json file")
    parser.add_argument("--workers", type=int, default=0, help="processes (0: one a CPU)")
    args = parser.parse_args(argv)
    if args.search:
        for key, blocks in search(args.workers).items():
            print(key, blocks)
        return 0
    if args.from_json:
        print(markdown(load(args.from_json)))
        return 0
    start = time.perf_counter()
    configs = aot.configurations()
    builds = aot.build_all(configs, workers=args.workers)
    problems = [(b.config, b.arch, b.problems) for b in builds if b.problems]
    seconds = time.perf_counter() - start
    print(f"{len(builds)} builds in {seconds:.0f} s, {len(problems)} with problems")
    for problem in problems:
        print(*problem)
    if args.json:
        args.json.write_text(json.dumps([b.as_dict() for b in builds], indent=1) + "\n")
    if args.markdown:
        print(markdown(builds))
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
