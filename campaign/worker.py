"""The fault campaign's workers: the launch script's training on one pair of ranks with
in-memory snapshots (``Trainer``, shared with campaign.recovery), the trials run on it
(``Campaign``, ``worker_main``), and on the driver's side the launch of the workers (a torchrun of
2 ranks each), the corpus they train on and the progress line."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

from campaign.outcomes import json_number, loss_deviation, magnitude_class, summarise
from campaign.plan import (
    CONFIG,
    LOGS,
    ROOT,
    Settings,
    fault_of,
    read_results,
    settings_from_json,
)

ENTRY = ["-m", "campaign.cli"]
"""What each worker's ranks run, from the repository root: its main() hands --worker-plan to
worker_main."""


# --- one pair of ranks: the launch script's training, with snapshots ------------------------


class Trainer:
    """The launch script's model, optimizer, schedule, data and train step on this rank, with
    a snapshot of the training state in memory that any window can start from."""

    def __init__(self, argv: list[str]):
        from megatron.core.rerun_state_machine import RerunMode, initialize_rerun_state_machine

        from pretrain import pretrain_gpt as launch

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
        from megatron_abft.runtime.guard import iter_guards

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

        from megatron_abft.runtime.guard import collective_device

        t = torch.tensor([value], dtype=torch.float64, device=collective_device())
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return float(t)

    def all_sum(self, values: list[float]) -> list[float]:
        import torch

        from megatron_abft.runtime.guard import collective_device

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
        record["reference_losses"] = [json_number(x) for x in reference["losses"]]
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


# --- the driver's side: launching the workers -----------------------------------------------


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
    texts = sorted(str(p) for p in (ROOT / "data" / "tiny_corpus").glob("*.txt"))
    command = [sys.executable, "-m", "tools.prepare_data", "--input", *texts]
    subprocess.run([*command, "--output-prefix", str(prefix)], cwd=ROOT, check=True)


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
                "--nproc-per-node", "2", *ENTRY, "--worker-plan", str(plan_file),
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
