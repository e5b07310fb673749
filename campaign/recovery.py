"""Recovery cost of one fault, measured side by side on the fault campaign's model.

The model, optimizer, data and train step are the launch script's (pretrain/pretrain_gpt.py) on 2
gloo ranks with TP=2 (configs/tiny_cpu.yaml), as in the fault campaign (campaign.cli). One fault
is handled by:

(a) in-step correction: the extra time of a protected step in which ABFT corrects a fault, over
    a clean protected step (the median of paired differences; the faults rotate over sections
    and kinds). The time of the correction alone (verify_and_correct on a faulty vs a clean
    scores matrix of this model) is reported beside it;
(b) Megatron's rerun of the step: one more forward-backward of that step, unprotected;
(c) restore from a disk checkpoint (dist_checkpointing, the launch script's save and load) and
    replay of the steps lost, at a checkpoint interval of 1 (ATTNChecker's setting) and 100: a
    fault lands uniformly within an interval, so (N + 1) / 2 steps are replayed on average
    (measured step time x that count; the load is measured);
(d) restore from an in-memory snapshot of parameters, optimizer and RNG states (REFT-style,
    "Reliable and Efficient In-Memory Fault Tolerance of LLM Pretraining", 2023) and replay.

What being ready costs per step is measured too: the checks of a clean protected step, a
checkpoint save, a snapshot. The table and its ratios to (a) go into docs/fault-campaign.md,
the numbers into docs/figures/recovery_cost.json.

    python -m tools.recovery_cost
    python -m tools.recovery_cost --reps 40 -- --seq-length 128   # flags after -- go to the
                                                                  # launch script's parser
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from campaign import worker
from campaign.cli import split_launch_flags
from campaign.plan import CORPUS, DEFAULT_DOC, ROOT, Settings, rel
from campaign.report import replace_block

SCRATCH = ROOT / "out" / "recovery_cost"
DOCS = {
    "json": ROOT / "docs" / "figures" / "recovery_cost.json",
    "doc": DEFAULT_DOC,
    "figure": ROOT / "docs" / "figures" / "recovery_cost.png",
}
"""The study's files where the docs keep them (``--update-docs``)."""
OUT = {
    "json": SCRATCH / "recovery_cost.json",
    "doc": SCRATCH / "fault-campaign.md",
    "figure": SCRATCH / "recovery_cost.png",
}
"""Its files otherwise: out/ holds what a run makes, docs/ what was published."""
BEGIN, END = "<!-- recovery:begin -->", "<!-- recovery:end -->"

FAULTS = (
    ("scores", "inf", "0d"),
    ("context", "nan", "row"),
    ("qkv", "near_inf", "0d"),
    ("proj", "-inf", "0d"),
    ("k", "nan", "0d"),
    ("scores", "bitflip", "col"),
)
"""The faults (a) corrects, in turn: sections, kinds and patterns of the campaign."""


# --- on the ranks --------------------------------------------------------------------------


class Clock:
    """Wall time of a region on every rank: device syncs and barriers around it, so it is the
    slowest rank's."""

    def __init__(self):
        import torch

        self.torch = torch

    def _sync(self) -> None:
        if self.torch.cuda.is_available():
            self.torch.cuda.synchronize()
        self.torch.distributed.barrier()

    def __enter__(self):
        self._sync()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self._sync()
        self.seconds = time.perf_counter() - self.start


def measure(options: dict) -> dict:
    """Every timing, on this rank; rank 0's result is the one written."""
    import torch

    from megatron_abft import Fault, reset_stats, stats

    trainer = worker.Trainer(options["launch_argv"])
    reps, ckpt_reps = options["reps"], options["ckpt_reps"]
    trainer.protect(False)
    data = trainer.batches(0)
    for _ in range(options["warmup"]):  # optimizer state exists, caches are warm
        trainer.step(data, [])
    base = trainer.snapshot()
    start = options["warmup"] * trainer.args.global_batch_size
    timings: dict[str, list[float]] = {}

    def timed_step(protect: bool, faults: list) -> float:
        trainer.restore(base)
        trainer.protect(protect)
        batches = trainer.batches(start)
        with Clock() as clock:
            trainer.step(batches, faults)
        return clock.seconds

    # (a) clean and faulty protected steps, paired and interleaved; the unprotected step
    reset_stats(trainer.gpt)
    clean, faulty, plain = [], [], []
    for i in range(reps):
        section, kind, pattern = FAULTS[i % len(FAULTS)]
        extra = {"bit": 30} if kind == "bitflip" else {}
        fault = Fault(section, kind, pattern, layer=1 + i % trainer.args.num_layers,
                      tp_rank=i % trainer.args.tensor_model_parallel_size,
                      step=base["iteration"] + 1, seed=i, **extra)  # fmt: skip
        order = [(False, []), (True, []), (True, [fault])]
        for protect, faults in order if i % 2 else reversed(order):
            seconds = timed_step(protect, faults)
            (faulty if faults else clean if protect else plain).append(seconds)
    counts = stats(trainer.gpt, group=torch.distributed.group.WORLD)
    corrected = sum(sum(c["corrected"].values()) for c in counts.values())
    uncorrectable = sum(sum(c["uncorrectable"].values()) for c in counts.values())
    if corrected != reps or uncorrectable:
        raise RuntimeError(
            f"(a) expected {reps} corrected faults and none uncorrectable, got {corrected} and "
            f"{uncorrectable}: the timed faults are not the ones measured"
        )
    timings["step_clean_protected"] = clean
    timings["step_fault_corrected"] = faulty
    timings["step_unprotected"] = plain
    timings["correction_extra"] = [f - c for f, c in zip(faulty, clean, strict=True)]
    timings["correction_alone"] = correction_alone(trainer, reps)

    # (b) one more forward-backward of the step, unprotected
    trainer.protect(False)
    forward_backward = []
    for _ in range(reps):
        trainer.restore(base)
        data = trainer.batches(start)
        batches = [next(data) for _ in range(trainer.args.num_microbatches)]
        with Clock() as clock:
            trainer.launch.forward_backward(
                trainer.args, trainer.model, trainer.step_func, iter(batches)
            )
        forward_backward.append(clock.seconds)
    timings["forward_backward"] = forward_backward

    # (c) dist_checkpointing save and load, as the launch script does them
    args = trainer.args
    saves, loads = [], []
    root = Path(options["scratch"])
    for i in range(ckpt_reps):
        trainer.restore(base)
        args.save = str(root / f"save{i}")
        with Clock() as clock:
            trainer.launch.save_checkpoint(args, trainer.iteration, trainer.gpt,
                                           trainer.optimizer, trainer.scheduler)  # fmt: skip
        saves.append(clock.seconds)
    for i in range(ckpt_reps):
        trainer.restore(base)
        trainer.scheduler.num_steps = 0  # load_checkpoint adds the saved count to it
        args.load, args.ckpt_step = str(root / f"save{i}"), None
        with Clock() as clock:
            trainer.launch.load_checkpoint(args, trainer.gpt, trainer.optimizer,
                                           trainer.scheduler)  # fmt: skip
        loads.append(clock.seconds)
    timings["checkpoint_save"] = saves
    timings["checkpoint_load"] = loads
    bytes_on_disk = sum(f.stat().st_size for f in (root / "save0").rglob("*") if f.is_file())

    # (d) in-memory snapshot and restore
    snaps, restores = [], []
    for _ in range(reps):
        trainer.restore(base)
        with Clock() as clock:
            snapshot = trainer.snapshot()
        snaps.append(clock.seconds)
        with Clock() as clock:
            trainer.restore(snapshot)
        restores.append(clock.seconds)
    timings["snapshot_take"] = snaps
    timings["snapshot_restore"] = restores

    parameters = sum(p.numel() for p in trainer.gpt.parameters())
    total = trainer.all_sum([float(parameters)])[0]
    torch.distributed.destroy_process_group()
    return {
        "timings": timings,
        "checkpoint_bytes": bytes_on_disk,
        "parameters_per_rank": parameters,
        "parameters_all_ranks": int(total),
        "model": {
            "layers": args.num_layers,
            "hidden": args.hidden_size,
            "heads": args.num_attention_heads,
            "seq": args.seq_length,
            "micro_batch": args.micro_batch_size,
            "tp": args.tensor_model_parallel_size,
        },
        "host": socket.gethostname(),
        "cpus": os.cpu_count(),
    }


def correction_alone(trainer, reps: int) -> list[float]:
    """verify_and_correct on one layer's scores of this model (per rank), with a fault minus
    without: the correction's own work, outside the step."""
    import torch

    from megatron_abft import GemmOperands, TensorFault, encode, inject_, verify_and_correct

    args = trainer.args
    heads = args.num_attention_heads // args.tensor_model_parallel_size
    head_dim = args.hidden_size // args.num_attention_heads
    batch, seq = args.micro_batch_size * heads, args.seq_length
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(batch, seq, head_dim, generator=generator)
    k = torch.randn(batch, seq, head_dim, generator=generator)
    operands = GemmOperands(q, k.mT, alpha=head_dim**-0.5)
    col, row = encode(q, k.mT, alpha=operands.alpha)
    clean = torch.baddbmm(torch.empty(batch, seq, seq), q, k.mT, beta=0.0, alpha=operands.alpha)

    def run(fault: bool) -> float:
        s = clean.clone()
        if fault:
            inject_(s, TensorFault("inf", seed=1))
        begin = time.perf_counter()
        verify_and_correct(s, col, row, operands=operands, check_references=False)
        return time.perf_counter() - begin

    for _ in range(3):  # warm-up
        run(False)
        run(True)
    return [run(True) - run(False) for _ in range(max(reps, 20))]


def worker_main(options_file: str) -> int:
    options = json.loads(Path(options_file).read_text())
    result = measure(options)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(options["out"]).write_text(json.dumps(result))
    return 0


# --- the table ---------------------------------------------------------------------------------


def median(values: list[float]) -> float:
    return statistics.median(values)


def spread(values: list[float]) -> str:
    """The interquartile range, as text."""
    if len(values) < 4:
        return "-"
    q = statistics.quantiles(values, n=4)
    return f"{_ms(q[0])}-{_ms(q[2])}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if abs(seconds) < 1 else f"{seconds:.3g} s"


def rows(result: dict, intervals: tuple[int, ...]) -> tuple[list[dict], dict]:
    """The recovery rows: what each method costs per fault, in seconds and in units of (a)."""
    t = {k: median(v) for k, v in result["timings"].items()}
    step = t["step_unprotected"]
    correction = t["correction_extra"]
    floor = t["correction_alone"]
    basis = correction
    basis_name = "(a) measured: the step with a corrected fault minus a clean protected step"
    if correction <= floor:  # below what the correction's own work costs: timer noise
        basis = floor
        basis_name = "(a) the correction's own work (the step difference was within noise)"
    out = [
        {
            "method": "(a) in-step correction (ABFT)",
            "measured": "protected step with a corrected fault minus a clean protected step "
            f"(median of {len(result['timings']['correction_extra'])} pairs); the correction "
            f"alone: {_ms(floor)}",
            "seconds": basis,
        },
        {
            "method": "(b) Megatron rerun of the step",
            "measured": "one forward-backward of the step, unprotected",
            "seconds": t["forward_backward"],
        },
    ]
    for n in intervals:
        lost = (n + 1) / 2
        out.append(
            {
                "method": f"(c) disk checkpoint, interval {n}",
                "measured": f"dist_checkpointing load ({_ms(t['checkpoint_load'])}) + "
                f"{lost:g} steps replayed x {_ms(step)}"
                + (" (computed from the measured step)" if n > 1 else ""),
                "seconds": t["checkpoint_load"] + lost * step,
                "ready_per_step": t["checkpoint_save"] / n,
            }
        )
    for n in intervals:
        lost = (n + 1) / 2
        out.append(
            {
                "method": f"(d) in-memory snapshot, interval {n}",
                "measured": f"copy back ({_ms(t['snapshot_restore'])}) + {lost:g} steps "
                f"replayed x {_ms(step)}" + (" (computed)" if n > 1 else ""),
                "seconds": t["snapshot_restore"] + lost * step,
                "ready_per_step": t["snapshot_take"] / n,
            }
        )
    out[0]["ready_per_step"] = t["step_clean_protected"] - step
    out[1]["ready_per_step"] = 0.0
    for row in out:
        row["ratio"] = row["seconds"] / basis
        # (a) is cheaper overall when faults come at least every `break_even` steps: its extra
        # ready cost per step times the steps between faults is below what it saves per fault
        extra = out[0]["ready_per_step"] - row["ready_per_step"]
        saved = row["seconds"] - basis
        row["break_even_steps"] = (
            None if row is out[0] else math.inf if extra <= 0 else saved / extra if saved > 0
            else 0.0
        )  # fmt: skip
    attn = {
        "save_plus_load": t["checkpoint_save"] + t["checkpoint_load"],
        "ratio": (t["checkpoint_save"] + t["checkpoint_load"]) / basis,
        "in_steps": (t["checkpoint_save"] + t["checkpoint_load"]) / step,
    }
    return out, {"basis": basis, "basis_name": basis_name, "medians": t, "attnchecker": attn}


def markdown(
    result: dict, intervals: tuple[int, ...], command: str, json_path: str
) -> tuple[str, dict]:
    table, extra = rows(result, intervals)
    t = extra["medians"]
    model = result["model"]
    lines = [
        f"Measured on the campaign's model ({model['layers']} layers, hidden {model['hidden']}, "
        f"{model['heads']} heads, seq {model['seq']}, micro-batch {model['micro_batch']}, "
        f"{result['parameters_all_ranks']:,} parameters over TP={model['tp']} gloo ranks, fp32) "
        f"on {result['cpus']} CPU cores. Medians; a clean unprotected step takes "
        f"{_ms(t['step_unprotected'])} (IQR {spread(result['timings']['step_unprotected'])}), a "
        f"clean protected step {_ms(t['step_clean_protected'])}. The checkpoint holds "
        f"{result['checkpoint_bytes'] / 1e6:.1f} MB.",
        "",
        "| recovery of one fault | measured | seconds | x (a) | ready cost per step | "
        "(a) cheaper overall with a fault every |",
        "|---|---|---|---|---|---|",
    ]
    for row in table:
        lines.append(
            f"| {row['method']} | {row['measured']} | {row['seconds']:.4g} | "
            f"{row['ratio']:,.0f} | {_ms(row['ready_per_step'])} | "
            f"{_steps(row['break_even_steps'])} |"
        )
    attn = extra["attnchecker"]
    lines += [
        "",
        f"Ratios are to {extra['basis_name']}: {_ms(extra['basis'])} (IQR of the paired "
        f'differences {spread(result["timings"]["correction_extra"])}). "Ready cost per step" '
        "is what a method costs on every step whether or not a fault comes: the checks (a "
        "clean protected step minus an unprotected one), a checkpoint save or a snapshot "
        "divided by the interval. The last column is where the two balance: with faults at "
        "least that often, the checks' ready cost is repaid by cheaper recoveries. "
        "ATTNChecker's C/R measure, save + load of one checkpoint, is "
        f"{_ms(attn['save_plus_load'])} here: {attn['in_steps']:.1f} training steps and "
        f"{attn['ratio']:,.0f}x (a).",
        "",
        f"Made by `{command}` (numbers: `{json_path}`).",
    ]
    return "\n".join(lines), {"rows": table, **extra}


def _steps(k: float | None) -> str:
    if k is None:
        return "-"
    if math.isinf(k):
        return "any rate"
    if k == 0:
        return "never"
    return f"<= {k:,.1f} steps" if k < 10 else f"<= {k:,.0f} steps"


def figure(table: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6), layout="constrained")
    names = [r["method"] for r in table]
    ax.barh(names, [r["seconds"] for r in table], color="#457b9d")
    for i, r in enumerate(table):
        ax.text(r["seconds"], i, f" {r['ratio']:,.0f}x", va="center", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlim(min(r["seconds"] for r in table) / 2, max(r["seconds"] for r in table) * 4)
    ax.invert_yaxis()
    ax.set_xlabel("seconds to recover from one fault (log)")
    ax.set_title("recovery cost, tiny GPT on 2 CPU ranks (TP=2)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- the driver --------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    argv, launch_flags = split_launch_flags(argv)
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Flags after -- go to pretrain_gpt.py's parser (e.g. -- --seq-length 128).",
    )
    p.add_argument("--reps", type=int, default=40, help="repetitions of each step timing")
    p.add_argument("--ckpt-reps", type=int, default=5, help="checkpoint saves and loads timed")
    p.add_argument("--warmup", type=int, default=5, help="training steps before timing")
    p.add_argument("--intervals", default="1,100", help="checkpoint/snapshot intervals, steps")
    p.add_argument(
        "--update-docs",
        action="store_true",
        help="numbers, table and figure where the docs keep them (docs/fault-campaign.md, "
        "docs/figures/); without it they go to out/recovery_cost/",
    )
    p.add_argument("--json", help="numbers ('' = none)")
    p.add_argument("--doc", help="markdown ('' = none)")
    p.add_argument("--figure", help="PNG ('' = none)")
    p.add_argument("--corpus", type=Path, default=CORPUS, help="indexed dataset prefix")
    p.add_argument(
        "--report-only", action="store_true", help="remake the table from --json, no measuring"
    )
    p.add_argument("--worker-options", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.launch_flags = launch_flags
    for name, path in (DOCS if args.update_docs else OUT).items():  # a path given wins
        if getattr(args, name) is None:
            setattr(args, name, str(path))
    if args.worker_options:
        return args
    for name in ("reps", "ckpt_reps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: use an int >= 1")
    if args.warmup < 1:
        p.error(f"--warmup {args.warmup}: use an int >= 1 (the optimizer needs its state)")
    try:
        args.intervals = tuple(int(x) for x in args.intervals.split(","))
    except ValueError:
        p.error(f"--intervals {args.intervals!r}: use comma-separated ints such as 1,100")
    if not args.intervals or min(args.intervals) < 1:
        p.error(f"--intervals {args.intervals}: use ints >= 1 such as 1,100")
    return args


def launch_argv(args: argparse.Namespace) -> list[str]:
    """The campaign's model, protected layers, policy skip_step, no stop on NaN."""
    settings = Settings(
        trials=1, controls=0, window=1, windows=1, warmup=args.warmup, seed=0,
        policy="skip_step", tolerance=1e-5, sections=(), kinds=(), patterns=(),
        launch_flags=tuple(args.launch_flags),
    )  # fmt: skip
    return worker.launch_argv(settings, args.corpus)


def measure_on_ranks(args: argparse.Namespace) -> dict | None:
    """Launch the measurement on 2 ranks; rank 0's numbers (None if it failed)."""
    worker.ensure_corpus(args.corpus)
    argv_launch = launch_argv(args)
    from pretrain import pretrain_gpt

    pretrain_gpt.parse_args(argv_launch, world_size=2)  # its errors, before any rank starts
    SCRATCH.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ckpt_", dir=SCRATCH) as scratch:
        out = Path(scratch, "result.json")
        options = {
            "launch_argv": argv_launch,
            "reps": args.reps,
            "ckpt_reps": args.ckpt_reps,
            "warmup": args.warmup,
            "scratch": scratch,
            "out": str(out),
        }
        options_file = Path(scratch, "options.json")
        options_file.write_text(json.dumps(options))
        env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
        env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", "2", "-m", "campaign.recovery",
            "--worker-options", str(options_file),
        ]  # fmt: skip
        print("measuring on 2 ranks (TP=2) ...", flush=True)
        started = time.perf_counter()
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode:
            print(done.stdout[-3000:] + done.stderr[-5000:], file=sys.stderr)
            print(f"the measurement failed (exit {done.returncode})", file=sys.stderr)
            return None
        result = json.loads(out.read_text())
        shutil.rmtree(Path(scratch), ignore_errors=True)
    print(f"measured in {time.perf_counter() - started:.0f} s")
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker_options:
        return worker_main(args.worker_options)
    if args.report_only:
        if not (args.json and Path(args.json).exists()):
            print(f"--report-only needs the numbers of a measurement: {args.json!r} is missing")
            return 1
        result = json.loads(Path(args.json).read_text())
        intervals, command = tuple(result["intervals"]), result["command"]
    else:
        result = measure_on_ranks(args)
        if result is None:
            return 1
        intervals, command = args.intervals, "python -m tools.recovery_cost" + _flags_of(args)
    text, numbers = markdown(result, intervals, command, rel(Path(args.json)) if args.json else "")
    result.update(numbers, intervals=list(intervals), command=command)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if args.figure:
        figure(numbers["rows"], Path(args.figure))
        where = os.path.relpath(args.figure, Path(args.doc or DEFAULT_DOC).parent)
        text += f"\n\n![recovery cost]({where})"
    if args.doc:
        replace_block(Path(args.doc), BEGIN, END, text)
    print(text)
    return 0


def _flags_of(args: argparse.Namespace) -> str:
    defaults = parse_args([])
    flags = [
        f"--{name.replace('_', '-')} {getattr(args, name)}"
        for name in ("reps", "ckpt_reps", "warmup")
        if getattr(args, name) != getattr(defaults, name)
    ]
    if args.intervals != defaults.intervals:
        flags.append(f"--intervals {','.join(map(str, args.intervals))}")
    if args.update_docs:
        flags.append("--update-docs")
    if args.launch_flags:
        flags.append("-- " + " ".join(args.launch_flags))
    return "".join(" " + f for f in flags)


if __name__ == "__main__":
    sys.exit(main())
