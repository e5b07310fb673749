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

    python tools/fault_campaign.py                      # the default campaign, then the report
    python tools/fault_campaign.py --trials 2000 --workers 2 --results out/big.jsonl
    python tools/fault_campaign.py --report-only        # tables and figure from the results
    python tools/fault_campaign.py --trials 40 -- --seq-length 32   # flags after -- go to the
                                                                    # launch script's parser
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "pretrain"))  # the launch script's functions (pretrain_gpt.py)

CONFIG = ROOT / "configs" / "tiny_cpu.yaml"
CORPUS = ROOT / "out" / "fault_campaign" / "corpus" / "tiny_corpus"
LOGS = ROOT / "out" / "fault_campaign" / "logs"
DEFAULT_RESULTS = ROOT / "docs" / "figures" / "campaign_trials.jsonl"
DEFAULT_DOC = ROOT / "docs" / "fault-campaign.md"
DEFAULT_FIGURE = ROOT / "docs" / "figures" / "campaign.png"
DEFAULT_VULNERABILITY = ROOT / "docs" / "figures" / "vulnerability.json"
DEFAULT_SUMMARY = ROOT / "docs" / "figures" / "campaign_summary.json"
BEGIN, END = "<!-- campaign:begin -->", "<!-- campaign:end -->"

SECTIONS = ("qkv", "q", "k", "v", "scores", "probs", "context", "proj")
"""The fault sections of megatron_abft.faults.MODEL_SECTIONS, in the order the tables use."""
PROTECTED = ("qkv", "q", "k", "v", "scores", "context", "proj")
"""Sections whose faults the checks cover; probs, the softmax output, is the blind spot."""
CHECKED_SECTION = {s: "qkv" if s in ("q", "k", "v") else s for s in SECTIONS}
CHECKED_SECTION["probs"] = "context"  # a fault in P lands in the context GEMM's input
KINDS = ("inf", "-inf", "nan", "near_inf", "bitflip", "value_1e1", "value_1e4", "value_1e8")
"""Campaign kinds: the fault kinds of megatron_abft.faults, with finite values at 3 magnitudes."""
PATTERNS = ("0d", "row", "col", "2d")
CORRECTABLE_PATTERNS = ("0d", "row", "col")
VULNERABILITY_SECTIONS = ("qkv", "scores", "context", "proj")
VULNERABILITY_KINDS = ("finite", "near_inf", "inf", "nan")  # megatron_abft.eec.KINDS
POLICIES = ("skip_step", "log")


# --- the plan: which trials, seeded ---------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """What makes a campaign: a results file is resumed only with the same settings."""

    trials: int
    controls: int
    window: int
    windows: int
    warmup: int
    seed: int
    policy: str
    tolerance: float
    sections: tuple[str, ...]
    kinds: tuple[str, ...]
    patterns: tuple[str, ...]
    launch_flags: tuple[str, ...]

    def as_json(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items()}


def plan(settings: Settings, num_layers: int, tp_size: int, dtype_bits: int) -> list[dict]:
    """Every trial of the campaign, from the seed alone. Faulty trials cycle through every
    section x kind x pattern in a shuffled order (a full pass before any repeats), each with a
    random step of the window, layer, TP rank, data window and position; ``controls`` clean
    trials are spread evenly among them."""
    rng = random.Random(settings.seed)
    combos = [
        (s, k, p) for s in settings.sections for k in settings.kinds for p in settings.patterns
    ]
    faulty = settings.trials - settings.controls
    chosen: list[tuple[str, str, str]] = []
    while len(chosen) < faulty:
        batch = combos[:]
        rng.shuffle(batch)
        chosen += batch
    chosen = chosen[:faulty]
    spacing = settings.trials / settings.controls if settings.controls else 0
    control_ids = {round((i + 0.5) * spacing) for i in range(settings.controls)}
    if settings.controls == settings.trials:  # spacing 1: rounding half to even would collide
        control_ids = set(range(settings.trials))
    trials, picks = [], iter(chosen)
    for trial_id in range(settings.trials):
        trial: dict = {
            "id": trial_id,
            "window": rng.randrange(settings.windows),
            "control": trial_id in control_ids,
        }
        if not trial["control"]:
            section, kind, pattern = next(picks)
            trial.update(
                section=section,
                kind=kind,
                pattern=pattern,
                step=rng.randint(1, settings.window),
                layer=rng.randint(1, num_layers),
                tp_rank=rng.randrange(tp_size),
                seed=rng.randrange(2**31),
            )
            sign = rng.choice((-1.0, 1.0))
            if kind.startswith("value_"):
                trial["value"] = sign * float(kind.split("_")[1])
            elif kind == "bitflip":
                trial["bit"] = rng.randrange(dtype_bits)
        trials.append(trial)
    return trials


def fault_of(trial: dict, iteration: int):
    """The megatron_abft Fault of a trial, landing at training iteration ``iteration``."""
    from megatron_abft import Fault

    kind = trial["kind"]
    extra = {}
    if kind.startswith("value_"):
        kind, extra = "value", {"value": trial["value"]}
    elif kind == "bitflip":
        extra = {"bit": trial["bit"]}
    return Fault(
        trial["section"],
        kind,
        trial["pattern"],
        layer=trial["layer"],
        tp_rank=trial["tp_rank"],
        step=iteration,
        seed=trial["seed"],
        **extra,
    )


# --- one pair of ranks: the launch script's training, with snapshots ------------------------


class Trainer:
    """The launch script's model, optimizer, schedule, data and train step on this rank, with
    a snapshot of the training state in memory that any window can start from."""

    def __init__(self, argv: list[str]):
        import pretrain_gpt as launch
        from megatron.core.rerun_state_machine import RerunMode, initialize_rerun_state_machine

        self.launch = launch
        self.args = args = launch.parse_args(argv)
        self.device = launch.initialize_distributed(args)
        tokenizer = launch.build_tokenizer(args)
        self.gpt, self.model = launch.build_model(args, tokenizer.vocab_size, self.device)
        self.optimizer, self.scheduler = launch.build_optimizer(args, self.model)
        self.dataset = launch.build_dataset(args, tokenizer)
        initialize_rerun_state_machine(mode=RerunMode("disabled"))
        self.step_func = partial(launch.forward_step, args, self.gpt, self.device)
        self.iteration = 0
        self.rank = launch.rank()

    # protection on and off in one model: the guards share one ABFTConfig
    def protect(self, on: bool) -> None:
        from megatron_abft.guard import iter_guards

        self.args.abft = on  # train_step applies the ABFT policy only with --abft
        for guard in iter_guards(self.gpt):
            guard.config.enabled = on

    def batches(self, start_sample: int):
        return self.launch.micro_batches(self.args, self.dataset, start_sample)

    def step(self, data, faults: list) -> tuple[float, bool, int]:
        """One training step of the launch script; returns (loss, skipped, faults landed)."""
        from megatron_abft import inject, set_step

        self.iteration += 1
        set_step(self.gpt, self.iteration)
        batches = [next(data) for _ in range(self.args.num_microbatches)]
        with inject(self.gpt, faults) as landed:
            loss, skipped, _, _ = self.launch.train_step(
                self.args,
                self.gpt,
                self.model,
                self.optimizer,
                self.scheduler,
                self.step_func,
                batches,
            )
        return float(loss), bool(skipped), len(landed)

    def snapshot(self) -> dict:
        """Parameters, optimizer state, LR schedule, RNG states and iteration, copied to host
        memory (the in-memory checkpoint of recovery (d) in docs/fault-campaign.md)."""
        import numpy as np
        import torch
        from megatron.core import tensor_parallel

        def copy(t):
            return t.detach().to("cpu", copy=True)

        return {
            "params": [copy(p) for p in self.gpt.parameters()],
            "main_params": [[copy(p) for p in g] for g in self._main_param_groups()],
            "optimizer": [
                {
                    i: {k: copy(v) if torch.is_tensor(v) else v for k, v in s.items()}
                    for i, s in enumerate(self._states(opt))
                }
                for opt in self._inner_optimizers()
            ],
            "scheduler": self.scheduler.num_steps,
            "rng": (
                random.getstate(),
                np.random.get_state(),
                torch.get_rng_state(),
                tensor_parallel.get_cuda_rng_tracker().get_states(),
            ),
            "iteration": self.iteration,
        }

    def restore(self, snapshot: dict) -> None:
        """Copy a snapshot back in place (parameters keep their storage, so Megatron's
        gradient buffers and the optimizer still point at them)."""
        import numpy as np
        import torch
        from megatron.core import tensor_parallel

        with torch.no_grad():
            for p, saved in zip(self.gpt.parameters(), snapshot["params"], strict=True):
                p.copy_(saved, non_blocking=True)
            for group, saved in zip(
                self._main_param_groups(), snapshot["main_params"], strict=True
            ):
                for p, s in zip(group, saved, strict=True):
                    p.copy_(s, non_blocking=True)
            for opt, saved in zip(self._inner_optimizers(), snapshot["optimizer"], strict=True):
                params = [p for g in opt.param_groups for p in g["params"]]
                opt.state.clear()
                for i, state in saved.items():
                    opt.state[params[i]] = {
                        k: v.to(params[i].device, copy=True) if torch.is_tensor(v) else v
                        for k, v in state.items()
                    }
        self.scheduler.num_steps = snapshot["scheduler"]
        self.scheduler.step(increment=0)  # sets the learning rate of that step
        python, numpy_state, torch_state, tracker = snapshot["rng"]
        random.setstate(python)
        np.random.set_state(numpy_state)
        torch.set_rng_state(torch_state)
        tensor_parallel.get_cuda_rng_tracker().set_states(tracker)
        self.iteration = snapshot["iteration"]

    def _inner_optimizers(self) -> list:
        chained = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        return [o.optimizer for o in chained]

    def _main_param_groups(self) -> list:
        """The fp32 main parameters of a bf16/fp16 optimizer (none in fp32 training)."""
        chained = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        return [g for o in chained for g in getattr(o, "fp32_from_float16_groups", [])]

    @staticmethod
    def _states(opt) -> list[dict]:
        params = [p for g in opt.param_groups for p in g["params"]]
        return [opt.state.get(p, {}) for p in params]

    # collectives over the job's ranks (on the device the backend needs: NCCL wants CUDA)
    def all_max(self, value: float) -> float:
        import torch

        from megatron_abft.guard import collective_device

        t = torch.tensor([value], dtype=torch.float64, device=collective_device())
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return float(t)

    def all_sum(self, values: list[float]) -> list[float]:
        import torch

        from megatron_abft.guard import collective_device

        t = torch.tensor(values, dtype=torch.float64, device=collective_device())
        torch.distributed.all_reduce(t)
        return t.tolist()


# --- one trial: a window with protection off, then on ----------------------------------------


class Campaign:
    """Runs trials on one pair of ranks: the base state after warm-up, one fault-free reference
    per data window (cached), then each trial's windows."""

    def __init__(self, trainer: Trainer, settings: Settings):
        self.t = trainer
        self.settings = settings
        trainer.protect(False)
        data = trainer.batches(0)
        for _ in range(settings.warmup):  # from initialisation to a model that has learnt a bit
            trainer.step(data, [])
        self.base = trainer.snapshot()
        self.references: dict[int, dict] = {}

    def start_sample(self, window: int) -> int:
        steps = self.settings.warmup + window * self.settings.window
        return steps * self.t.args.global_batch_size

    def reference(self, window: int) -> dict:
        if window not in self.references:
            self.references[window] = self.run(window, None, protect=False, keep_params=True)
        return self.references[window]

    def run(self, window: int, trial: dict | None, protect: bool, keep_params=False) -> dict:
        """Train one window from the base state; the trial's fault lands at its step."""
        import torch

        from megatron_abft import collect_events, reset_stats, stats

        t = self.t
        t.restore(self.base)
        t.protect(protect)
        reset_stats(t.gpt)
        data = t.batches(self.start_sample(window))
        losses, skipped, landed = [], [], 0
        for k in range(1, self.settings.window + 1):
            due = trial is not None and trial["step"] == k
            faults = [fault_of(trial, t.iteration + 1)] if due else []
            loss, skip, n = t.step(data, faults)
            losses.append(loss)
            skipped.append(skip)
            landed += n
        params = [p.detach() for p in t.gpt.parameters()]
        nonfinite = any(not bool(torch.isfinite(p).all()) for p in params)
        result = {
            "losses": losses,
            "skipped": skipped,
            "landed": int(t.all_sum([landed])[0]),
            "nonfinite_params": bool(t.all_max(float(nonfinite))),
        }
        if keep_params:
            result["params"] = [p.clone() for p in params]
        else:
            reference = self.reference(window)
            diff = ref = 0.0
            for p, r in zip(params, reference["params"], strict=True):
                diff += float((p.double() - r.double()).pow(2).sum())
                ref += float(r.double().pow(2).sum())
            diff, ref = t.all_sum([diff, ref])
            result["param_deviation"] = math.sqrt(diff / ref) if math.isfinite(diff) else math.inf
            result["loss_deviation"] = loss_deviation(losses, skipped, reference["losses"])
        if protect:
            counts = stats(t.gpt, group=torch.distributed.group.WORLD)
            result["counts"] = {
                s: {o: sum(c[o].values()) for o in ("detected", "corrected", "uncorrectable")}
                for s, c in counts.items()
            }
            result["detected_kinds"] = {
                s: [k for k, n in c["detected"].items() if n] for s, c in counts.items()
            }
            events: list = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(events, collect_events(t.gpt))
            result["events"] = [e for rank_events in events for e in rank_events]
        return result

    def trial(self, trial: dict) -> dict:
        """Both runs of one trial, summarised for the JSONL."""
        started = time.perf_counter()
        record = dict(trial)
        window = trial["window"]
        reference = self.reference(window)
        record["reference_losses"] = [_num(x) for x in reference["losses"]]
        runs = {"on": self.run(window, trial if not trial["control"] else None, protect=True)}
        if not trial["control"]:
            runs["off"] = self.run(window, trial, protect=False)
        for mode, run in runs.items():
            record[mode] = summarise(
                run, trial, self.settings.tolerance, self.base["iteration"] + 1
            )
        record["class"] = None if trial["control"] else magnitude_class(trial, record["on"])
        record["seconds"] = round(time.perf_counter() - started, 3)
        return record


def loss_deviation(losses: list[float], skipped: list[bool], reference: list[float]) -> float:
    """Largest relative difference from the fault-free losses over the steps not skipped."""
    worst = 0.0
    for loss, skip, ref in zip(losses, skipped, reference, strict=True):
        if skip:
            continue
        if not math.isfinite(loss):
            return math.inf
        worst = max(worst, abs(loss - ref) / abs(ref))
    return worst


def summarise(run: dict, trial: dict, tolerance: float, first_step: int) -> dict:
    """What one run of a trial did to training, and (protection on) what ABFT saw."""
    applied = [x for x, skip in zip(run["losses"], run["skipped"], strict=True) if not skip]
    nonfinite_loss = any(not math.isfinite(x) for x in applied)
    out = {
        "landed": run["landed"],
        "losses": [_num(x) for x in run["losses"]],
        "skipped_steps": sum(run["skipped"]),
        "nonfinite_loss": nonfinite_loss,
        "nonfinite_params": run["nonfinite_params"],
        "non_trainable": nonfinite_loss or run["nonfinite_params"],
        "loss_deviation": _num(run["loss_deviation"]),
        "param_deviation": _num(run["param_deviation"]),
    }
    if "counts" in run:
        counts = run["counts"]
        out["detected"] = sum(c["detected"] for c in counts.values())
        out["corrected"] = sum(c["corrected"] for c in counts.values())
        out["uncorrectable"] = sum(c["uncorrectable"] for c in counts.values())
        out["counts"] = {s: c for s, c in counts.items() if any(c.values())}
        out["detected_kinds"] = {s: k for s, k in run["detected_kinds"].items() if k}
        where = Counter(
            f"step {e['step'] - first_step + 1} layer {e['layer']} {e['section']} "
            f"tp{e['tp_rank']} {e['action']}"
            for e in run["events"]
        )
        out["events"] = [f"{n}x {w}" if n > 1 else w for w, n in sorted(where.items())][:12]
        if not trial["control"]:  # checks flagged elsewhere than where the fault landed
            home = (trial["layer"], CHECKED_SECTION[trial["section"]], trial["tp_rank"])
            out["flagged_elsewhere"] = sum(
                1 for e in run["events"] if (e["layer"], e["section"], e["tp_rank"]) != home
            )
    out["outcome"] = classify(out, trial["control"], tolerance)
    return out


OUTCOMES_OFF = ("non_trainable", "deviated", "masked")
OUTCOMES_ON = ("corrected", "reported", "masked", "silent", "miscorrected")
OUTCOMES_CONTROL = ("clean", "false_alarm", "deviated")


def classify(run: dict, control: bool, tolerance: float) -> str:
    """What a fault did in one run.

    Protection off: ``non_trainable``; ``deviated`` (the loss or the parameters moved by more
    than ``tolerance``, relative); ``masked`` (no effect). Protection on: ``corrected`` (detected,
    every detection corrected, no effect left); ``reported`` (counted uncorrectable, so the
    policy acted); ``masked`` (not detected and no effect: below the detection limit, or
    harmless); ``silent`` (not detected, yet training changed); ``miscorrected`` (corrected,
    yet training changed). Clean controls: ``clean``, ``false_alarm`` or ``deviated``."""
    effect = run["non_trainable"] or not (
        _float(run["loss_deviation"]) <= tolerance and _float(run["param_deviation"]) <= tolerance
    )
    if "detected" not in run:
        return "non_trainable" if run["non_trainable"] else "deviated" if effect else "masked"
    if control:
        return "false_alarm" if run["detected"] else "deviated" if effect else "clean"
    if not run["detected"]:
        return "silent" if effect else "masked"
    if run["uncorrectable"]:
        return "reported"
    return "miscorrected" if effect else "corrected"


def magnitude_class(trial: dict, on: dict) -> str:
    """The eec.KINDS class of a fault, for the vulnerability file: -inf counts as inf, a finite
    value below near-INF (1e10) as finite; a bitflip as what the checks measured in its section
    (the worst kind detected), finite when too small to be detected."""
    kind = trial["kind"]
    if kind in ("inf", "-inf"):
        return "inf"
    if kind in ("nan", "near_inf"):
        return kind
    if kind.startswith("value_"):
        return "near_inf" if abs(trial["value"]) >= 1e10 else "finite"
    seen = on.get("detected_kinds", {}).get(CHECKED_SECTION[trial["section"]], [])
    return max(seen, key=VULNERABILITY_KINDS.index) if seen else "finite"


def _num(x: float) -> float | str:
    """A float for JSON: non-finite values as strings, as the telemetry writes them."""
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return float(f"{x:.9g}")


def _float(x: float | str) -> float:
    return float(x)  # float("nan") and float("inf") read the strings back


def worker_main(plan_file: str) -> int:
    """One worker: a torchrun of 2 ranks that runs its share of the trials."""
    job = json.loads(Path(plan_file).read_text())
    settings = settings_from_json(job["settings"])
    trainer = Trainer(job["launch_argv"])
    campaign = Campaign(trainer, settings)
    fd = os.open(job["results"], os.O_WRONLY | os.O_APPEND | os.O_CREAT) if not trainer.rank else -1
    try:
        for trial in job["trials"]:
            record = campaign.trial(trial)
            record["worker"] = job["worker"]
            if fd >= 0:  # one write per line: appends from several workers never interleave
                os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        if fd >= 0:
            os.close(fd)
    import torch

    torch.distributed.destroy_process_group()
    return 0


# --- the campaign driver --------------------------------------------------------------------


def settings_from_json(data: dict) -> Settings:
    return Settings(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


def read_results(path: Path) -> tuple[dict | None, list[dict], list[dict]]:
    """(campaign settings, trial records, session records) of a results file."""
    header, trials, sessions = None, [], []
    if not path.exists():
        return header, trials, sessions
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            # a line cut short by a kill: the trial is simply run again
            print(f"{path}:{number}: skipping an incomplete line", file=sys.stderr)
            continue
        if "campaign" in record:
            header = record["campaign"]
        elif "session" in record:
            sessions.append(record["session"])
        else:
            trials.append(record)
    return header, trials, sessions


def launch_argv(settings: Settings, corpus: Path) -> list[str]:
    """The launch script's flags for the campaign's model (the tiny config, protected layers,
    no stopping on NaN: the campaign watches for it)."""
    iters = max(100, settings.warmup + settings.windows * settings.window + 1)
    return [
        "--config", str(CONFIG), "--data-path", str(corpus),
        "--tokenizer-type", "ByteLevelTokenizer", "--train-iters", str(iters),
        "--abft", "--abft-on-uncorrectable", settings.policy, "--abft-inject-every", "0",
        "--no-check-for-nan-in-loss-and-grad", "--wandb-project", "",
        "--save", str(ROOT / "out" / "fault_campaign" / "run"),
        *settings.launch_flags,
    ]  # fmt: skip


def ensure_corpus(prefix: Path) -> None:
    if Path(f"{prefix}.bin").exists() and Path(f"{prefix}.idx").exists():
        return
    sys.path.insert(0, str(ROOT / "tools"))
    import prepare_data

    prepare_data.build(sorted((ROOT / "data" / "tiny_corpus").glob("*.txt")), str(prefix))


def run_workers(todo: list[dict], settings: Settings, results: Path, workers: int, argv) -> int:
    """Launch the workers (a torchrun of 2 ranks each), show progress until they finish.
    Returns the number of workers that failed."""
    LOGS.mkdir(parents=True, exist_ok=True)
    shares = [todo[i::workers] for i in range(workers)]
    children, logs = [], []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "")}  # fmt: skip
    env = {k: v for k, v in env.items() if not k.startswith("WANDB_")}
    with tempfile.TemporaryDirectory(prefix="fault_campaign_") as scratch:
        for i, share in enumerate(shares):
            if not share:
                continue
            plan_file = Path(scratch, f"worker{i}.json")
            job = {"worker": i, "settings": settings.as_json(), "launch_argv": argv,
                   "results": str(results), "trials": share}  # fmt: skip
            plan_file.write_text(json.dumps(job))
            log = LOGS / f"worker{i}.log"
            logs.append(log)
            command = [
                sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", __file__, "--worker-plan", str(plan_file),
            ]  # fmt: skip
            with open(log, "w") as sink:
                children.append(
                    subprocess.Popen(
                        command, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )  # fmt: skip
        try:
            show_progress(children, results, len(todo))
        except KeyboardInterrupt:
            for child in children:  # the process groups this driver started
                os.killpg(child.pid, signal.SIGTERM)
            print("\ninterrupted: run the same command again to resume", file=sys.stderr)
            raise
    failed = 0
    for child, log in zip(children, logs, strict=True):
        if child.returncode:
            failed += 1
            tail = "\n".join(log.read_text().splitlines()[-30:])
            print(f"\nworker failed (exit {child.returncode}); log {log}:\n{tail}", file=sys.stderr)
    return failed


def show_progress(children: list, results: Path, total: int) -> None:
    """A progress line from the results file, until every worker has exited."""
    _, done_before, _ = read_results(results)
    start, before = time.perf_counter(), len(done_before)
    tty, last_shown = sys.stdout.isatty(), -1.0
    while True:
        finished = all(c.poll() is not None for c in children)
        done = len(_quiet_count(results)) - before
        elapsed = time.perf_counter() - start
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = (total - done) / rate if rate > 0 else float("nan")
        line = (
            f"  trials {done:>5}/{total}  {100 * done / max(total, 1):5.1f}%  "
            f"{rate:5.2f} trials/s  elapsed {elapsed:6.0f} s  ETA {eta:6.0f} s"
        )
        if tty:
            print("\r" + line, end="", flush=True)
        elif finished or elapsed - last_shown >= 30:
            print(line, flush=True)
            last_shown = elapsed
        if finished:
            if tty:
                print()
            return
        time.sleep(1.0)


def _quiet_count(results: Path) -> list[str]:
    if not results.exists():
        return []
    return [x for x in results.read_text().splitlines() if x.startswith('{"id"')]


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
    p.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="the trials (JSONL)")
    p.add_argument("--restart", action="store_true", help="discard the results file first")
    p.add_argument("--report-only", action="store_true", help="only remake the report")
    p.add_argument("--doc", default=str(DEFAULT_DOC), help="markdown to update ('' = none)")
    p.add_argument("--figure", default=str(DEFAULT_FIGURE), help="PNG figure ('' = none)")
    p.add_argument(
        "--vulnerability", default=str(DEFAULT_VULNERABILITY), help="JSON for the optimizer"
    )
    p.add_argument("--summary", default=str(DEFAULT_SUMMARY), help="JSON of the tables")
    p.add_argument("--corpus", type=Path, default=CORPUS, help="indexed dataset prefix")
    p.add_argument("--worker-plan", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.launch_flags = launch_flags
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
        import pretrain_gpt

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
            f"{len(finished)} already in {_rel(results)}, {len(todo)} to run on "
            f"{args.workers} worker(s) x 2 ranks; worker logs in {_rel(LOGS)}",
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
                }
                f.write(json.dumps({"session": session}) + "\n")
            print(f"ran {ran} trials in {wall:.0f} s")
            if failed:
                print(f"{failed} worker(s) failed; run the same command again to resume")
                return 1
    write_report(results, args)
    return 0


def _end_last_line(path: Path) -> None:
    if path.exists() and path.stat().st_size:
        with open(path, "rb+") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")


def _rel(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


# --- the report -------------------------------------------------------------------------------


def _share(hits: int, total: int) -> str:
    return f"{hits}/{total}" if total else "-"


def _percent(hits: int, total: int) -> str:
    return f"{100 * hits / total:.0f}% ({hits}/{total})" if total else "-"


def outcomes(trials: list[dict], mode: str, settings: Settings) -> list[str]:
    return [classify(t[mode], t["control"], settings.tolerance) for t in trials]


def rate_grid(trials: list[dict], mode: str, settings: Settings) -> dict:
    """{section: {kind: [non-trainable, trials]}}, with "all" rows and columns."""
    grid: dict = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for t in trials:
        for section in (t["section"], "all"):
            for kind in (t["kind"], "all"):
                cell = grid[section][kind]
                cell[0] += int(t[mode]["non_trainable"])
                cell[1] += 1
    return grid


def vulnerability(trials: list[dict]) -> tuple[dict, dict]:
    """P(non-trainable | a fault of class k in section s, protection off) from the 0d trials
    (a soft error corrupts one element of a GEMM output); q, k and v count as qkv. A class with
    no 0d trial falls back to the 0d/row/col trials, then to frequency.DEFAULT_VULNERABILITY.
    Returns (probabilities, {section: {class: (non-trainable, trials, basis)}})."""
    from megatron_abft.frequency import DEFAULT_VULNERABILITY

    tally: dict = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    wider: dict = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for t in trials:
        section = CHECKED_SECTION[t["section"]] if t["section"] != "probs" else None
        if section is None or t["pattern"] not in CORRECTABLE_PATTERNS:
            continue
        for table in (wider, tally) if t["pattern"] == "0d" else (wider,):
            table[section][t["class"]][0] += int(t["off"]["non_trainable"])
            table[section][t["class"]][1] += 1
    probabilities, basis = {}, {}
    for section in VULNERABILITY_SECTIONS:
        probabilities[section], basis[section] = {}, {}
        for kind in VULNERABILITY_KINDS:
            for name, table in (("0d", tally), ("0d/row/col", wider)):
                hits, total = table[section][kind]
                if total:
                    probabilities[section][kind] = round(hits / total, 4)
                    basis[section][kind] = (hits, total, name)
                    break
            else:
                probabilities[section][kind] = DEFAULT_VULNERABILITY[kind]
                basis[section][kind] = (None, 0, "default")
    return probabilities, basis


def optimizer_check(path: Path) -> dict:
    """Load the vulnerability file through the launch script's flags, as a run would, and ask
    the check-frequency optimizer for intervals (equal fault rates, 99% coverage, H100 costs)."""
    import pretrain_gpt

    from megatron_abft.megatron_lm import coverage_intervals

    args = pretrain_gpt.parse_args(
        ["--config", str(CONFIG), "--mock-data", "--wandb-project", "", "--save", "",
         "--abft", "--abft-coverage-target", "0.99", "--abft-vulnerability", str(path)],
        world_size=2,
    )  # fmt: skip
    return coverage_intervals(args)


def tables(trials: list[dict], settings: Settings, sessions: list[dict], paths: dict) -> tuple:
    """The report's markdown and its numbers."""
    faulty = [t for t in trials if not t["control"]]
    controls = [t for t in trials if t["control"]]
    protected = [t for t in faulty if t["section"] in PROTECTED]
    probs = [t for t in faulty if t["section"] == "probs"]
    one_d = [t for t in protected if t["pattern"] in CORRECTABLE_PATTERNS]
    on = dict(zip((t["id"] for t in faulty), outcomes(faulty, "on", settings), strict=True))
    off = dict(zip((t["id"] for t in faulty), outcomes(faulty, "off", settings), strict=True))
    control_outcomes = Counter(outcomes(controls, "on", settings))
    sections = [s for s in SECTIONS if s in settings.sections]
    kinds = [k for k in KINDS if k in settings.kinds]
    patterns = [p for p in PATTERNS if p in settings.patterns]

    def count(group, table, *names):
        return sum(1 for t in group if table[t["id"]] in names)

    corrected = count(one_d, on, "corrected")
    masked = count(one_d, on, "masked")
    nt_on_1d = sum(t["on"]["non_trainable"] for t in one_d)
    not_corrected = [t for t in protected if on[t["id"]] != "corrected"]
    uncorrectable = [t for t in protected if t["on"]["uncorrectable"]]
    silent = count(protected, on, "silent", "miscorrected")
    elsewhere = sum(
        1 for t in protected if on[t["id"]] == "corrected" and t["on"]["flagged_elsewhere"]
    )
    control_detections = sum(t["on"]["detected"] for t in controls)
    control_deviation = max((_float(t["on"]["loss_deviation"]) for t in controls), default=0.0)
    control_params = max((_float(t["on"]["param_deviation"]) for t in controls), default=0.0)
    headline = {
        "corrected_0d_row_col": [corrected, len(one_d) - masked],
        "masked_0d_row_col": masked,
        "non_trainable_on_0d_row_col": [nt_on_1d, len(one_d)],
        "uncorrectable_reported": [len(uncorrectable), len(uncorrectable)],
        "silent_protected": [silent, len(protected)],
        "corrected_flagged_elsewhere": elsewhere,
        "control_detections": control_detections,
        "control_trials": len(controls),
        "control_max_loss_deviation": control_deviation,
        "control_max_param_deviation": control_params,
        "probs_silent": [count(probs, on, "silent"), len(probs)],
    }
    ok = {
        True: "yes",
        False: "**NO**",
    }
    lines = []
    add = lines.append
    wall = sum(s["wall_s"] for s in sessions)
    ran = sum(s["trials"] for s in sessions)
    workers = sorted({s["workers"] for s in sessions})
    add(
        f"{len(trials)} trials ({len(faulty)} with a fault, {len(controls)} clean controls), "
        f"each {settings.window} steps with protection off and on, from a snapshot after "
        f"{settings.warmup} warm-up steps, on {settings.windows} data windows; policy "
        f"`{settings.policy}` with protection on; effect tolerance {settings.tolerance:g} "
        f"(relative, on the loss and on the parameters). "
        + (
            f"Wall time {wall:.0f} s for {ran} trials ({wall / max(ran, 1):.2f} s per trial) "
            f"with {'/'.join(map(str, workers))} worker(s) of 2 ranks on "
            f"{sessions[-1]['cpus']} CPU cores"
            + (f", over {len(sessions)} sessions" if len(sessions) > 1 else "")
            + "."
            if sessions
            else ""
        )
    )
    add("")
    add("**What it shows** (protection on):")
    add("")
    add("| claim | measured | holds |")
    add("|---|---|---|")
    for pattern in [p for p in CORRECTABLE_PATTERNS if p in settings.patterns]:
        group = [t for t in one_d if t["pattern"] == pattern]
        fixed, quiet = count(group, on, "corrected"), count(group, on, "masked")
        others = Counter(f"{on[t['id']]} ({t['kind']})" for t in group
                         if on[t["id"]] not in ("corrected", "masked"))  # fmt: skip
        headline[f"corrected_{pattern}"] = [fixed, len(group) - quiet, quiet]
        text = f"{_share(fixed, len(group) - quiet)} detected ones corrected"
        if quiet:
            text += f"; {quiet} more below the detection limit changed nothing"
        if others:
            text += "; instead: " + ", ".join(f"{n} {what}" for what, n in sorted(others.items()))
        add(
            f"| {pattern} faults in protected sections are corrected in place | {text} | "
            f"{ok[not others]} |"
        )
    add(
        f"| none of them leaves training non-trainable | {_share(nt_on_1d, len(one_d))} "
        f"non-trainable | {ok[nt_on_1d == 0]} |"
    )
    add(
        f"| every fault not corrected in place is reported | {len(uncorrectable)} counted "
        f"uncorrectable, each handled by `{settings.policy}`; the "
        f"{len(not_corrected) - len(uncorrectable)} others were not detected and changed "
        f"nothing | {ok[silent == 0]} |"
    )
    add(
        f"| no silent corruption in protected sections (undetected or miscorrected faults that "
        f"changed training) | {_share(silent, len(protected))} | {ok[silent == 0]} |"
    )
    add(
        f"| a corrected fault leaves no trace in any other check | "
        f"{elsewhere} corrected trials with flags elsewhere | {ok[elsewhere == 0]} |"
    )
    add(
        f"| no detection in clean controls | {control_detections} detections in "
        f"{len(controls)} trials of {settings.window} steps (every check of every layer and "
        f"rank); largest deviation from the unprotected run: loss {control_deviation:.1e}, "
        f"parameters {control_params:.1e} | "
        f"{ok[control_detections == 0]} |"
    )
    probs_silent = count(probs, on, "silent")
    add(
        f"| probs (softmax output, the blind spot) | silent corruption in "
        f"{_percent(probs_silent, len(probs))}; {count(probs, on, 'reported')} reported (a "
        f"non-finite P makes the context checksums non-finite), "
        f"{count(probs, on, 'masked')} without effect | documented |"
    )
    add("")

    def grid_table(mode: str, title: str) -> None:
        grid = rate_grid(faulty, mode, settings)
        add(f"**{title}**: non-trainable trials / trials, by section and kind.")
        add("")
        add("| section | " + " | ".join(k.replace("_", " ") for k in kinds) + " | all |")
        add("|---" * (len(kinds) + 2) + "|")
        for section in [*sections, "all"]:
            cells = [_share(*grid[section][k]) for k in kinds]
            add(
                f"| {'**all**' if section == 'all' else section} | " + " | ".join(cells)
                + f" | {_percent(*grid[section]['all'])} |"
            )  # fmt: skip
        add("")

    grid_table("off", "Protection off (ATTNChecker's study, on Megatron-core)")
    grid_table("on", "Protection on")

    add(
        "**Outcomes by section**. Off: non-trainable, deviated (finite but the loss or the "
        "parameters moved beyond the tolerance), no effect. On: corrected in place, reported "
        "uncorrectable (the policy skipped the step), undetected without effect, silent."
    )
    add("")
    add(
        "| section | trials | off: non-trainable | off: deviated | off: no effect | "
        "on: corrected | on: reported | on: undetected, no effect | on: silent |"
    )
    add("|---" * 9 + "|")
    by_section = {}
    for section in [*sections, "all"]:
        group = [t for t in faulty if section in ("all", t["section"])]
        row = {
            "trials": len(group),
            **{f"off_{o}": count(group, off, o) for o in OUTCOMES_OFF},
            **{f"on_{o}": count(group, on, o) for o in OUTCOMES_ON},
        }
        by_section[section] = row
        n = len(group)
        add(
            f"| {section} | {n} | {_percent(row['off_non_trainable'], n)} | "
            f"{_percent(row['off_deviated'], n)} | {_percent(row['off_masked'], n)} | "
            f"{_percent(row['on_corrected'], n)} | {_percent(row['on_reported'], n)} | "
            f"{_percent(row['on_masked'], n)} | "
            f"{_percent(row['on_silent'] + row['on_miscorrected'], n)} |"
        )
    add("")

    add("**Coverage by pattern**, protected sections (probs left out), protection on.")
    add("")
    add("| pattern | trials | corrected | reported | undetected, no effect | silent | "
        "off: non-trainable |")  # fmt: skip
    add("|---" * 7 + "|")
    for pattern in patterns:
        group = [t for t in protected if t["pattern"] == pattern]
        n = len(group)
        add(
            f"| {pattern} | {n} | {_percent(count(group, on, 'corrected'), n)} | "
            f"{_percent(count(group, on, 'reported'), n)} | "
            f"{_percent(count(group, on, 'masked'), n)} | "
            f"{_percent(count(group, on, 'silent', 'miscorrected'), n)} | "
            f"{_percent(count(group, off, 'non_trainable'), n)} |"
        )
    add("")

    flips = [t for t in faulty if t["kind"] == "bitflip"]
    if flips:
        add(
            "**Random bit flips by bit** (fp32: sign 31, exponent 23-30, mantissa 0-22), all "
            "sections."
        )
        add("")
        add("| bits | trials | off: non-trainable | off: no effect | on: detected | "
            "on: undetected, no effect | on: silent |")  # fmt: skip
        add("|---" * 7 + "|")
        for name, bits in (("sign (31)", {31}), ("top exponent (30)", {30}),
                           ("exponent (23-29)", set(range(23, 30))),
                           ("mantissa (0-22)", set(range(23)))):  # fmt: skip
            group = [t for t in flips if t["bit"] in bits]
            n = len(group)
            detected = sum(1 for t in group if t["on"]["detected"])
            add(
                f"| {name} | {n} | {_percent(count(group, off, 'non_trainable'), n)} | "
                f"{_percent(count(group, off, 'masked'), n)} | {_percent(detected, n)} | "
                f"{_percent(count(group, on, 'masked'), n)} | "
                f"{_percent(count(group, on, 'silent', 'miscorrected'), n)} |"
            )
        add("")

    probabilities, basis = vulnerability(faulty)
    add(
        "**Vulnerability** for the check-frequency optimizer: P(non-trainable | one fault of "
        "that class in that section, protection off), from the 0d trials (q, k and v count as "
        "qkv). Classes as `megatron_abft.eec.KINDS`: INF and -INF are `inf`; finite values "
        "below 1e10 are `finite`; a bit flip is the class the checks measured for it (the worst "
        "kind detected in its section), `finite` when it was too small to detect. "
        f"Written to `{paths['vulnerability']}`."
    )
    add("")
    add("| section | " + " | ".join(VULNERABILITY_KINDS) + " |")
    add("|---" * (len(VULNERABILITY_KINDS) + 1) + "|")
    for section in VULNERABILITY_SECTIONS:
        cells = []
        for kind in VULNERABILITY_KINDS:
            hits, total, name = basis[section][kind]
            p = probabilities[section][kind]
            cells.append(
                f"{p:.2f} ({hits}/{total})" if name == "0d"
                else f"{p:.2f} ({hits}/{total}, {name})" if total
                else f"{p:.2f} (no trials: default)"
            )  # fmt: skip
        add(f"| {section} | " + " | ".join(cells) + " |")
    add("")
    numbers = {
        "headline": headline,
        "by_section": by_section,
        "non_trainable_off": _plain(rate_grid(faulty, "off", settings)),
        "non_trainable_on": _plain(rate_grid(faulty, "on", settings)),
        "controls": dict(control_outcomes),
        "vulnerability": probabilities,
        "wall_seconds": wall,
        "trials": len(trials),
    }
    return "\n".join(lines), numbers


def _plain(grid: dict) -> dict:
    return {s: {k: list(v) for k, v in row.items()} for s, row in grid.items()}


def figure(trials: list[dict], settings: Settings, path: Path) -> None:
    """Protection off: the non-trainable rate and the rate of any effect, by section and kind;
    protection on: what happened to the faults of each section."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    faulty = [t for t in trials if not t["control"]]
    sections = [s for s in SECTIONS if s in settings.sections]
    kinds = [k for k in KINDS if k in settings.kinds]
    off = {t["id"]: o for t, o in zip(faulty, outcomes(faulty, "off", settings), strict=True)}
    fig, axes = plt.subplots(1, 3, figsize=(17, 5), layout="constrained")
    panels = (
        (axes[0], ("non_trainable",), "protection off: non-trainable"),
        (axes[1], ("non_trainable", "deviated"), "protection off: non-trainable or deviated"),
    )
    for ax, hits, title in panels:
        rates = np.full((len(sections), len(kinds)), np.nan)
        for i, s in enumerate(sections):
            for j, k in enumerate(kinds):
                group = [t for t in faulty if t["section"] == s and t["kind"] == k]
                if group:
                    n = sum(off[t["id"]] in hits for t in group)
                    rates[i, j] = n / len(group)
                    ax.text(j, i, f"{n}/{len(group)}", ha="center", va="center", fontsize=7,
                            color="white" if n / len(group) > 0.6 else "black")  # fmt: skip
        image = ax.imshow(rates, vmin=0, vmax=1, cmap="Reds")
        ax.set_xticks(range(len(kinds)), [k.replace("value_", "±") for k in kinds], rotation=40)
        ax.set_yticks(range(len(sections)), sections)
        ax.set_title(title)
    fig.colorbar(image, ax=axes[:2], fraction=0.03, label="share of trials")
    ax = axes[2]
    colours = {"corrected": "#2a9d8f", "reported": "#e9c46a", "masked": "#bbbbbb",
               "silent": "#e63946", "miscorrected": "#6d0000"}  # fmt: skip
    left = np.zeros(len(sections))
    shares = {o: [] for o in colours}
    for s in sections:
        group = [t for t in faulty if t["section"] == s]
        found = Counter(outcomes(group, "on", settings))
        for o in colours:
            shares[o].append(found[o] / max(len(group), 1))
    for o, colour in colours.items():
        label = "undetected, no effect" if o == "masked" else o
        ax.barh(sections, shares[o], left=left, color=colour, label=label)
        left += np.array(shares[o])
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of trials")
    stuck = sum(t["on"]["non_trainable"] for t in faulty)
    ax.set_title(f"protection on: outcome (non-trainable: {stuck}/{len(faulty)})")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def replace_block(doc: Path, begin: str, end: str, body: str) -> None:
    """Put ``body`` between the markers of ``doc`` (appended, with markers, if they are absent)."""
    text = doc.read_text() if doc.exists() else ""
    block = f"{begin}\n{body.rstrip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + ("\n\n" if text else "") + block + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)


def write_report(results: Path, args: argparse.Namespace) -> dict:
    """Tables (markdown block in --doc), figure, vulnerability JSON and summary JSON."""
    header, trials, sessions = read_results(results)
    settings = settings_from_json(header)
    trials = sorted(trials, key=lambda t: t["id"])
    if not trials:
        print(f"{results}: no trials yet")
        return {}
    paths = {"vulnerability": _rel(args.vulnerability) if args.vulnerability else "(not written)"}
    markdown, numbers = tables(trials, settings, sessions, paths)
    if args.vulnerability:
        path = Path(args.vulnerability)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(numbers["vulnerability"], indent=1) + "\n")
        numbers["optimizer_intervals"] = optimizer_check(path)
        chosen = ", ".join(f"{s} {'off' if n is None else f'every {n}'}"
                           for s, n in numbers["optimizer_intervals"].items())  # fmt: skip
        markdown += (
            f"\nLoaded by the launch script (`--abft-coverage-target 0.99 --abft-vulnerability "
            f"{_rel(path)}`, equal fault rates, H100 check costs, the tiny model's shape), the "
            f"optimizer checks: {chosen}.\n"
        )
    command = "python tools/fault_campaign.py" + _flags_of(settings, args)
    markdown += f"\nMade by `{command}` (results: `{_rel(results)}`).\n"
    if args.figure:
        figure(trials, settings, Path(args.figure))
        where = os.path.relpath(args.figure, Path(args.doc or DEFAULT_DOC).parent)
        markdown += f"\n![fault campaign]({where})\n"
    if args.summary:
        Path(args.summary).write_text(json.dumps(numbers, indent=1) + "\n")
    if args.doc:
        replace_block(Path(args.doc), BEGIN, END, markdown)
    print(markdown)
    return numbers


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
    if args.results != DEFAULT_RESULTS:
        flags.append(f"--results {_rel(args.results)}")
    if settings.launch_flags:
        flags.append("-- " + " ".join(settings.launch_flags))
    return "".join(" " + f for f in flags)


if __name__ == "__main__":
    sys.exit(main())
