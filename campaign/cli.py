"""Fault-injection campaign: which soft errors, where in attention, make training non-trainable,
with ABFT protection off and on (ATTNChecker's study, reproduced on Megatron-core).

A small GPT (configs/tiny_cpu.yaml: 2 layers, hidden 64, 4 heads, seq 64) trains on 2 gloo ranks
with TP=2, built by the launch script's own functions (pretrain/pretrain_gpt.py: model, optimizer,
data, train step). After a short warm-up its state is snapshotted. Each trial restores the
snapshot and trains a short window (4 steps) on one of a few data windows, twice: with protection
off and with protection on. One fault lands at a random step of the window, in a random layer,
TP rank and position, of a section (qkv, its q/k/v parts, scores, probs, context, proj), a kind
(INF, -INF, NaN, near-INF, a flip of a random bit, or a finite value of magnitude 1e1, 1e4 or 1e8)
and a pattern (one element, a whole row or column, a 2D block). Clean control trials inject
nothing. Each trial records what ABFT detected, corrected and could not correct, whether training
became non-trainable (a NaN/INF loss or parameter) and how far the loss strayed from the
fault-free run of the same window.

Trials run in worker processes, each a pair of ranks (a torchrun) that builds the model once and
runs many trials; results are appended to a JSONL file per trial, and a campaign that stops is
resumed from that file (trials already there are skipped). At the end the tables go into
docs/fault-campaign.md, the figure into docs/figures/campaign.png and the measured per-section
vulnerabilities into docs/figures/vulnerability.json, the file the check-frequency optimizer reads
(``pretrain_gpt.py --abft-coverage-target P --abft-vulnerability FILE``).

    python -m tools.fault_campaign                      # the default campaign, then the report
    python -m tools.fault_campaign --trials 2000 --workers 2 --results out/big.jsonl
    python -m tools.fault_campaign --report-only        # tables and figure from the results
    python -m tools.fault_campaign --trials 40 -- --seq-length 32   # flags after -- go to the
                                                                    # launch script's parser

This module is the command line (tools/fault_campaign.py runs it; the workers' ranks run it
with --worker-plan). The campaign itself: plan.py (settings, fault space, the seeded trials, the
results file), worker.py (training on a pair of ranks, running trials, launching the workers),
outcomes.py (what a trial did: its outcome) and report.py (tables, figure, vulnerability file).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from campaign.plan import (
    CORPUS,
    DOCS,
    KINDS,
    LOGS,
    OUT,
    PATTERNS,
    POLICIES,
    SECTIONS,
    Settings,
    plan,
    read_results,
    rel,
    settings_from_json,
)
from campaign.report import write_report
from campaign.worker import ensure_corpus, launch_argv, run_workers, worker_main
from megatron_abft.ops import compiled


def split_launch_flags(argv: list[str] | None) -> tuple[list[str], list[str]]:
    """A tool's own flags and, after ``--``, those it hands to pretrain_gpt.py's parser."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        return argv, []
    at = argv.index("--")
    return argv[:at], argv[at + 1 :]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    argv, launch_flags = split_launch_flags(argv)
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Flags after -- go to pretrain_gpt.py's parser (e.g. -- --seq-length 32).",
    )
    p.add_argument("--trials", type=int, default=568, help="trials, clean controls included")
    p.add_argument(
        "--controls", type=int, default=None, help="clean control trials (default: trials / 10)"
    )
    p.add_argument("--window", type=int, default=4, help="training steps per trial run")
    p.add_argument("--windows", type=int, default=4, help="distinct data windows")
    p.add_argument("--warmup", type=int, default=20, help="steps trained before the snapshot")
    p.add_argument("--workers", type=int, default=1, help="parallel workers, 2 ranks each")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--policy",
        choices=POLICIES,
        default="skip_step",
        help="--abft-on-uncorrectable with protection on (skip_step: every rank skips a step "
        "with an uncorrectable fault)",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=1e-5,
        help="relative deviation of the loss and of the parameters from the fault-free run "
        "below which a fault had no effect (corrected faults stay below 1e-6)",
    )
    p.add_argument("--sections", default=",".join(SECTIONS), help="fault sections to cover")
    p.add_argument("--kinds", default=",".join(KINDS), help="fault kinds to cover")
    p.add_argument("--patterns", default=",".join(PATTERNS), help="fault patterns to cover")
    p.add_argument(
        "--update-docs",
        action="store_true",
        help="results, report, figure and JSON where the docs keep them (docs/fault-campaign.md, "
        "docs/figures/); without it they go to out/fault_campaign/",
    )
    p.add_argument("--results", type=Path, help="the trials (JSONL)")
    p.add_argument("--restart", action="store_true", help="discard the results file first")
    p.add_argument("--report-only", action="store_true", help="only remake the report")
    p.add_argument("--doc", help="markdown to update ('' = none)")
    p.add_argument("--figure", help="PNG figure ('' = none)")
    p.add_argument("--vulnerability", help="JSON for the optimizer ('' = none)")
    p.add_argument("--summary", help="JSON of the tables ('' = none)")
    p.add_argument("--corpus", type=Path, default=CORPUS, help="indexed dataset prefix")
    p.add_argument("--worker-plan", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.launch_flags = launch_flags
    home = DOCS if args.update_docs else OUT
    for name, path in home.items():  # a path given wins
        if getattr(args, name) is None:
            setattr(args, name, path if name == "results" else str(path))
    if args.worker_plan:
        return args
    problems = []
    for name in ("trials", "window", "windows", "workers"):
        if getattr(args, name) < 1:
            problems.append(f"--{name} {getattr(args, name)}: use an int >= 1")
    if args.warmup < 0:
        problems.append(f"--warmup {args.warmup}: use an int >= 0")
    if args.controls is None:
        args.controls = args.trials // 10
    if not 0 <= args.controls <= args.trials:
        problems.append(f"--controls {args.controls}: use 0 up to --trials ({args.trials})")
    if not args.tolerance > 0:
        problems.append(f"--tolerance {args.tolerance}: use a positive number such as 1e-4")
    for name, known in (("sections", SECTIONS), ("kinds", KINDS), ("patterns", PATTERNS)):
        chosen = tuple(x.strip() for x in getattr(args, name).split(",") if x.strip())
        unknown = [x for x in chosen if x not in known]
        if unknown or not chosen:
            problems.append(
                f"--{name} {getattr(args, name)!r}: unknown {unknown[0] if unknown else 'empty'}; "
                f"choose from {','.join(known)}"
            )
        setattr(args, name, chosen)
    if problems:
        p.error("\n  ".join(problems))
    return args


def settings_of(args: argparse.Namespace) -> Settings:
    """The campaign the command line describes."""
    return Settings(
        trials=args.trials,
        controls=args.controls,
        window=args.window,
        windows=args.windows,
        warmup=args.warmup,
        seed=args.seed,
        policy=args.policy,
        tolerance=args.tolerance,
        sections=args.sections,
        kinds=args.kinds,
        patterns=args.patterns,
        launch_flags=tuple(args.launch_flags),
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker_plan:
        return worker_main(args.worker_plan)
    settings = settings_of(args)
    results = args.results
    if args.restart and results.exists() and not args.report_only:
        results.unlink()
    header, done, _ = read_results(results)
    if args.report_only:
        if header is None:
            print(f"{results}: no campaign there; run it first (drop --report-only)")
            return 1
        settings = settings_from_json(header)
    elif header is not None and header != settings.as_json():
        differ = [k for k, v in settings.as_json().items() if header.get(k) != v]
        print(
            f"{results} holds a campaign with other settings ({', '.join(differ)}: "
            f"{', '.join(f'{k}={header.get(k)!r}' for k in differ)}); rerun with those, pass "
            "--restart to discard it, or choose another --results file",
            file=sys.stderr,
        )
        return 2
    if not args.report_only:
        ensure_corpus(args.corpus)
        argv = launch_argv(settings, args.corpus)
        from pretrain import pretrain_gpt

        launch = pretrain_gpt.parse_args(argv, world_size=2)  # its errors, before any rank
        if launch.pipeline_model_parallel_size != 1:
            print(
                f"--pipeline-model-parallel-size {launch.pipeline_model_parallel_size}: the "
                "campaign reads the loss on every rank, so it runs without pipeline "
                "parallelism; drop the flag (TP=2 is the default)",
                file=sys.stderr,
            )
            return 2
        bits = 16 if (launch.bf16 or launch.fp16) else 32
        trials = plan(settings, launch.num_layers, launch.tensor_model_parallel_size, bits)
        finished = {t["id"] for t in done}
        todo = [t for t in trials if t["id"] not in finished]
        results.parent.mkdir(parents=True, exist_ok=True)
        _end_last_line(results)  # a line cut short by a kill must not swallow the next one
        if header is None:
            with open(results, "a") as f:
                f.write(json.dumps({"campaign": settings.as_json()}) + "\n")
        print(
            f"fault campaign: {len(trials)} trials ({settings.controls} clean controls), "
            f"{len(finished)} already in {rel(results)}, {len(todo)} to run on "
            f"{args.workers} worker(s) x 2 ranks; worker logs in {rel(LOGS)}",
            flush=True,
        )
        if todo:
            start = time.perf_counter()
            failed = run_workers(todo, settings, results, args.workers, argv)
            wall = time.perf_counter() - start
            _, after, _ = read_results(results)
            ran = len(after) - len(done)
            with open(results, "a") as f:
                session = {
                    "wall_s": round(wall, 1),
                    "trials": ran,
                    "workers": args.workers,
                    "cpus": os.cpu_count(),
                    "date": time.strftime("%Y-%m-%d %H:%M"),
                    "kernels": compiled.backend(),
                    "softmax": "fused" if launch.abft_fused_softmax else "Megatron's",
                }
                f.write(json.dumps({"session": session}) + "\n")
            print(f"ran {ran} trials in {wall:.0f} s")
            if failed:
                print(f"{failed} worker(s) failed; run the same command again to resume")
                return 1
    write_report(results, args, "python -m tools.fault_campaign" + _flags_of(settings, args))
    return 0


def _end_last_line(path: Path) -> None:
    if path.exists() and path.stat().st_size:
        with open(path, "rb+") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")


def _flags_of(settings: Settings, args: argparse.Namespace) -> str:
    """The command-line flags that differ from the defaults, to quote the command."""
    defaults = parse_args([])
    flags = []
    for name in ("trials", "controls", "window", "windows", "warmup", "seed", "policy",
                 "tolerance"):  # fmt: skip
        value = getattr(settings, name)
        if value != getattr(defaults, name):
            flags.append(f"--{name} {value}")
    for name in ("sections", "kinds", "patterns"):
        if tuple(getattr(settings, name)) != tuple(getattr(defaults, name)):
            flags.append(f"--{name} {','.join(getattr(settings, name))}")
    if args.update_docs:
        flags.append("--update-docs")
    if args.results != (DOCS if args.update_docs else OUT)["results"]:
        flags.append(f"--results {rel(args.results)}")
    if settings.launch_flags:
        flags.append("-- " + " ".join(settings.launch_flags))
    return "".join(" " + f for f in flags)


if __name__ == "__main__":
    sys.exit(main())
