"""Fault telemetry: ABFT counters and fault events, gathered once per log interval, written to the
console, a JSON Lines file and Weights & Biases.

``Telemetry(model, config)`` is driven by the training loop: ``count_injected(n)`` after a step
that injected faults, ``log(iteration, metrics)`` at every log interval, ``close()`` at the end.
``log`` is a collective (every rank calls it): one all-reduce of the counters (by rank, layer,
section, outcome and kind) and, only when some rank saw a fault, one gather of the events to the
logging rank. Between log intervals nothing is synchronised: the guards count on the device.

The logging rank (the last one, as in Megatron-LM) prints a console line in Megatron's style, a
loud line for every fault that the recompute policy cleared or that lay only in masked scores
(the rank that finds an uncorrectable fault prints it at once:
megatron_abft.runtime.model_runtime.report), appends the events to the JSONL file and logs
``abft/*`` scalars beside the training metrics to W&B, with a table of the events at the end.
``wandb`` is imported only when a W&B project is given, and runs offline unless
``WANDB_API_KEY`` is set or ``wandb_mode`` says otherwise.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch
from torch import Tensor

from megatron_abft.check.eec import KINDS, OUTCOMES
from megatron_abft.config import SECTIONS, Policy
from megatron_abft.runtime.guard import SectionGuard, collect_events, iter_guards
from megatron_abft.runtime.model_runtime import fault_line, runtimes

COUNTS: tuple[str, ...] = (*OUTCOMES, "recomputed", "harmless")
"""What is counted per section and kind: detected, corrected, uncorrectable and, of the
uncorrectable (kind ``finite`` slot), GEMMs the recompute policy computed again and checks
whose faults lay only where the softmax masks the scores."""

EVENT_COLUMNS: tuple[str, ...] = (
    "step",
    "rank",
    "tp_rank",
    "layer",
    "section",
    "sample",
    "head",
    "row",
    "col",
    "kind",
    "magnitude",
    "action",
    "policy",
)
"""One fault event: where (rank, layer, section; micro-batch sample and head for the per-head
matrices, -1 for the linear layers; the most wrong flagged row and column, -1 where none), what
(kind, magnitude of the error) and what was done: corrected in place, recomputed, masked
(harmless: only where the softmax masks the scores), or uncorrectable (then handled by
``policy``)."""

WANDB_MODES: tuple[str, ...] = ("online", "offline", "disabled")
MAX_TABLE_ROWS = 10_000
"""Events kept for the W&B table; every event goes to the JSONL file."""

CONSOLE_FORMATS: dict[str, tuple[str, str]] = {
    "consumed-samples": ("consumed samples", "{:12d}"),
    "iteration-time": ("elapsed time per iteration (ms)", "{:.1f}"),
    "learning-rate": ("learning rate", "{:.6E}"),
    "batch-size": ("global batch size", "{:5d}"),
    "lm loss": ("lm loss", "{:.6E}"),
    "grad-norm": ("grad norm", "{:.3f}"),
    "tokens-per-sec": ("tokens per second", "{:.1f}"),
    "skipped-iterations": ("number of skipped iterations", "{:3d}"),
    "nan-iterations": ("number of nan iterations", "{:3d}"),
}
"""Megatron-LM's labels and formats for the metrics of the console line (W&B keys on the left)."""


@dataclass
class TelemetryConfig:
    """Where fault telemetry goes."""

    log_interval: int = 10
    """Steps between two gathers (and console lines)."""

    train_iters: int | None = None
    """Shown in the console line as ``iteration i/ N``."""

    events_file: str | None = None
    """JSON Lines file every fault event is appended to, created with the first one; None:
    none."""

    policy: str = Policy.RECOMPUTE
    """The on_uncorrectable policy, recorded with each event."""

    wandb_project: str | None = None
    """W&B project; None: no W&B run."""

    wandb_exp_name: str | None = None
    """W&B run name (required with a project, as in Megatron-LM)."""

    wandb_save_dir: str | None = None
    """Where W&B writes the run (default ./wandb)."""

    wandb_mode: str | None = None
    """online, offline or disabled; None: offline unless WANDB_API_KEY is set."""

    wandb_entity: str | None = None

    run_config: dict[str, Any] = field(default_factory=dict)
    """Logged as the W&B run's config (e.g. the launch arguments)."""

    def __post_init__(self) -> None:
        if isinstance(self.log_interval, bool) or not isinstance(self.log_interval, int):
            raise ValueError(
                f"TelemetryConfig.log_interval: {self.log_interval!r}; use an int >= 1"
            )
        if self.log_interval < 1:
            raise ValueError(f"TelemetryConfig.log_interval: {self.log_interval}; use an int >= 1")
        if self.wandb_mode is not None and self.wandb_mode not in WANDB_MODES:
            raise ValueError(
                f"TelemetryConfig.wandb_mode: {self.wandb_mode!r}; choose from "
                f"{', '.join(WANDB_MODES)}"
            )
        if self.wandb_project and not self.wandb_exp_name:
            raise ValueError(
                f"a W&B project ({self.wandb_project!r}) needs a run name: set "
                "--wandb-exp-name (wandb_exp_name)"
            )

    @property
    def resolved_wandb_mode(self) -> str:
        if self.wandb_mode is not None:
            return self.wandb_mode
        return "online" if os.environ.get("WANDB_API_KEY") else "offline"


@dataclass
class Interval:
    """What one ``log`` call gathered, the same on every rank (events: logging rank only)."""

    iteration: int
    totals: dict[str, int]
    """Counts since the start: injected, detected, corrected, uncorrectable, recomputed,
    harmless."""
    delta: dict[str, int]
    """The same counts in this interval."""
    scalars: dict[str, float]
    """The ``abft/*`` scalars logged to W&B."""
    events: list[dict]


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _world() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def _finite_or_text(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)


class Telemetry:
    """Counters and events of one model's ABFT guards, gathered and written once per interval."""

    def __init__(
        self,
        model: torch.nn.Module | Iterable[torch.nn.Module],
        config: TelemetryConfig | None = None,
        *,
        num_layers: int | None = None,
        logging_rank: int | None = None,
        device: torch.device | str | None = None,
        wandb_run: Any = None,
        stream: TextIO | None = None,
    ):
        self.chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
        self.config = config if config is not None else TelemetryConfig()
        self.rank, self.world = _rank(), _world()
        self.logging_rank = self.world - 1 if logging_rank is None else logging_rank
        self.is_logging_rank = self.rank == self.logging_rank
        guards = [g for c in self.chunks for g in iter_guards(c)]
        self.sections = {g.section for g in guards}  # the attention's own: scalars for these
        layers = [g.layer for g in guards if g.layer is not None]
        for runtime in runtimes(guards):
            runtime.loop_logs = True  # this Telemetry logs: the runtime's own stands down
            if self.config.events_file:  # every event reaches this file, via the logging rank
                runtime.telemetry_writes_events = True
        self.num_layers = num_layers or max(layers, default=1)
        self.device = torch.device(device) if device is not None else self._default_device()
        self.stream = stream or sys.stdout
        self.injected = 0  # faults landed on this rank since the last gather
        self.previous = {k: 0 for k in ("injected", *COUNTS)}
        self.events: list[dict] = []  # for the W&B table (logging rank)
        self.last_iteration = 0
        self.layer_counts = torch.zeros(self.num_layers, len(SECTIONS), len(COUNTS), len(KINDS))
        self.rank_counts = torch.zeros(self.world, len(SECTIONS), len(COUNTS), len(KINDS))
        self.events_file: TextIO | None = None
        self.wandb_run = wandb_run if self.is_logging_rank else None
        self._owns_wandb_run = False
        if self.is_logging_rank:
            if self.wandb_run is None and self.config.wandb_project:
                self.wandb_run = self._start_wandb()
                self._owns_wandb_run = True

    # --- set-up ------------------------------------------------------------------------------

    def _default_device(self) -> torch.device:
        if torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _start_wandb(self) -> Any:
        import wandb  # only when a W&B sink is requested

        config = self.config
        save_dir = config.wandb_save_dir or "wandb"
        os.makedirs(save_dir, exist_ok=True)
        return wandb.init(
            project=config.wandb_project,
            name=config.wandb_exp_name,
            entity=config.wandb_entity,
            dir=save_dir,
            mode=config.resolved_wandb_mode,
            config=config.run_config,
            settings=wandb.Settings(quiet=True),
        )

    @property
    def wandb_dir(self) -> str | None:
        """The W&B run directory (``.../wandb/offline-run-*``) on the logging rank."""
        run_dir = getattr(self.wandb_run, "dir", None)
        return os.path.dirname(run_dir) if run_dir else None

    # --- per step ----------------------------------------------------------------------------

    def count_injected(self, n: int) -> None:
        """Faults landed on this rank in the last step (``len`` of what ``inject`` yields)."""
        self.injected += n

    # --- per log interval --------------------------------------------------------------------

    def gather(self, iteration: int) -> Interval:
        """Collective: this interval's counters summed over ranks, and the events (to the logging
        rank). One host sync for the events, one all-reduce, and one gather if any rank has
        events."""
        events = [e for chunk in self.chunks for e in collect_events(chunk)]
        for event in events:
            event["policy"] = self.config.policy
        shape = (len(SECTIONS), len(COUNTS), len(KINDS))
        by_layer = self._by_layer([g for chunk in self.chunks for g in iter_guards(chunk)])
        by_rank = torch.zeros(self.world, *shape, dtype=torch.int64, device=self.device)
        by_rank[self.rank] = by_layer.sum(0)
        extra = torch.zeros(self.world, 2, dtype=torch.int64, device=self.device)
        extra[self.rank, 0], extra[self.rank, 1] = len(events), self.injected
        self.injected = 0
        flat = torch.cat([by_layer.flatten(), by_rank.flatten(), extra.flatten()])
        if self.world > 1:
            torch.distributed.all_reduce(flat)
        flat = flat.cpu()
        n_layer, n_rank = by_layer.numel(), by_rank.numel()
        self.layer_counts = flat[:n_layer].view(by_layer.shape)
        self.rank_counts = flat[n_layer : n_layer + n_rank].view(by_rank.shape)
        extra = flat[n_layer + n_rank :].view(extra.shape)
        if self.world > 1 and int(extra[:, 0].sum()):
            gathered: list[Any] | None = [None] * self.world if self.is_logging_rank else None
            torch.distributed.gather_object(events, gathered, dst=self.logging_rank)
            events = [e for part in (gathered or []) for e in part]
        events.sort(key=lambda e: (e["step"], e["rank"], e["layer"] or 0))
        totals = {
            "injected": self.previous["injected"] + int(extra[:, 1].sum()),
            **{name: int(self.layer_counts[:, :, i].sum()) for i, name in enumerate(COUNTS)},
        }
        delta = {k: totals[k] - self.previous[k] for k in totals}
        self.previous = totals
        return Interval(iteration, totals, delta, self._scalars(totals), events)

    def _scalars(self, totals: dict[str, int]) -> dict[str, float]:
        """``abft/*`` W&B scalars: totals, per section and per kind for every outcome; per layer
        and per rank only where something was detected."""
        scalars: dict[str, float] = {f"abft/{k}": float(v) for k, v in totals.items()}
        # each table summed as a tensor and read as lists: an element read apiece took hundreds
        # of ops a log
        by_section = self.layer_counts.sum(dim=(0, 3)).tolist()  # [section, count]
        for section, row in zip(SECTIONS, by_section, strict=True):
            if section in self.sections:
                for name, value in zip(COUNTS, row, strict=True):
                    scalars[f"abft/{section}/{name}"] = float(value)
        by_kind = self.layer_counts[:, :, : len(OUTCOMES)].sum(dim=(0, 1)).tolist()  # [out, kind]
        for k, kind in enumerate(KINDS):
            for name, row in zip(OUTCOMES, by_kind, strict=True):
                scalars[f"abft/kind/{kind}/{name}"] = float(row[k])
        for counts, label in ((self.layer_counts, "layer"), (self.rank_counts, "rank")):
            per = counts[:, :, : len(OUTCOMES)].sum(dim=(1, 3)).tolist()  # [n, outcome]
            offset = 1 if label == "layer" else 0  # Megatron's layer numbers start at 1
            for n, row in enumerate(per):
                if row[0]:
                    for name, value in zip(OUTCOMES, row, strict=True):
                        scalars[f"abft/{label}{n + offset}/{name}"] = float(value)
        return scalars

    def log(self, iteration: int, metrics: dict[str, float] | None = None) -> Interval:
        """Collective: gather, then (logging rank) print, append the events to the JSONL file and
        log ``metrics`` and the ``abft/*`` scalars to W&B at step ``iteration``."""
        interval = self.gather(iteration)
        self.last_iteration = iteration
        if not self.is_logging_rank:
            return interval
        metrics = dict(metrics or {})
        self._print(self._console_line(iteration, metrics, interval))
        for event in interval.events:
            if event["action"] in ("recomputed", "masked"):  # the others were printed at once
                self._print(self._settled_line(event))
        if self.config.events_file and interval.events:
            if self.events_file is None:  # created with the first event, not at start
                os.makedirs(
                    os.path.dirname(os.path.abspath(self.config.events_file)), exist_ok=True
                )
                self.events_file = open(self.config.events_file, "a")  # noqa: SIM115
            for event in interval.events:
                record = {k: event.get(k) for k in EVENT_COLUMNS}
                record["magnitude"] = _finite_or_text(float(event["magnitude"]))
                self.events_file.write(json.dumps(record) + "\n")
            self.events_file.flush()
        self.events.extend(interval.events[: max(0, MAX_TABLE_ROWS - len(self.events))])
        if self.wandb_run is not None:
            self.wandb_run.log({**metrics, **interval.scalars}, step=iteration)
        return interval

    def _by_layer(self, guards: list[SectionGuard]) -> Tensor:
        """This rank's counters ``[layers, sections, COUNTS, kinds]``: the guards' counts, their
        GEMMs recomputed and their harmless faults, each added in one op for all guards (a
        flash layer holds seven: a few ops a guard made thousands a log at 24 layers)."""
        sections, kinds = len(SECTIONS), len(KINDS)
        table = torch.zeros(
            self.num_layers * sections, len(COUNTS), kinds, dtype=torch.int64, device=self.device
        )

        def add(into: Tensor, values: list[Tensor], of: list[SectionGuard]) -> None:
            if of:
                at = [((g.layer or 1) - 1) * sections + SECTIONS.index(g.section) for g in of]
                index = torch.tensor(at, device=self.device)
                into.index_add_(0, index, torch.stack(values).to(self.device))

        counted = [g for g in guards if g.counts is not None]
        add(table[:, : len(OUTCOMES)], [g.counts for g in counted], counted)
        for i, name in enumerate(("recomputed", "harmless")):
            settled = [g for g in guards if getattr(g, name) is not None]
            add(table[:, len(OUTCOMES) + i, 0], [getattr(g, name) for g in settled], settled)
        return table.view(self.num_layers, sections, len(COUNTS), kinds)

    def _console_line(self, iteration: int, metrics: dict[str, float], interval: Interval) -> str:
        """Megatron-LM's training log line, with the interval's ABFT counts at the end."""
        total = f"{self.config.train_iters:8d}" if self.config.train_iters else "       ?"
        parts = [f" iteration {iteration:8d}/{total}"]
        for key, value in metrics.items():
            label, style = CONSOLE_FORMATS.get(key, (key.replace("-", " "), "{:.4g}"))
            scale = 1000.0 if key == "iteration-time" else 1.0
            shown = int(value) if style.endswith("d}") else value * scale
            parts.append(f" {label}: {style.format(shown)}")
        d = interval.delta
        parts.append(
            f" abft injected/detected/corrected/uncorrectable: {d['injected']}/{d['detected']}/"
            f"{d['corrected']}/{d['uncorrectable']}"
        )
        return " |".join(parts) + " |"

    def _settled_line(self, event: dict) -> str:
        """A fault uncorrectable in place that the recompute policy cleared by computing its
        GEMM again, or that lay only where the softmax masks the scores."""
        what = (
            f"sample {event['sample']} head {event['head']} row {event['row']} col "
            f"{event['col']}: {event['kind']}, magnitude {float(event['magnitude']):.3g}"
        )
        if event["action"] == "masked":
            return fault_line(
                event, f"{what}; only where the softmax masks the scores: harmless, not acted on"
            )
        return fault_line(event, f"{what}; recomputed the GEMM; the fault is gone")

    def _print(self, line: str) -> None:
        print(line, file=self.stream, flush=True)

    # --- end -----------------------------------------------------------------------------------

    def close(self, summary: dict[str, Any] | None = None) -> None:
        """Log the events table and ``summary`` to W&B, finish the run and close the JSONL file.
        Not a collective: call ``log`` first for the last interval."""
        if self.wandb_run is not None:
            import wandb

            table = wandb.Table(columns=list(EVENT_COLUMNS))
            for event in self.events:
                row = [event.get(k) for k in EVENT_COLUMNS]
                row[EVENT_COLUMNS.index("magnitude")] = float(event["magnitude"])
                table.add_data(*row)
            self.wandb_run.log({"abft/events": table}, step=self.last_iteration)
            for key, value in self.previous.items():
                self.wandb_run.summary[f"abft/{key}"] = value
            for key, value in (summary or {}).items():
                self.wandb_run.summary[key] = value
            if self._owns_wandb_run:
                self.wandb_run.finish()
        if self.events_file is not None:
            self.events_file.close()
            self.events_file = None


_SAID: set[str] = set()


def say_once(logger: logging.Logger, line: str, level: int = logging.INFO) -> None:
    """Log ``line`` once a process, from the first rank only where ranks are up: for what the
    launch decided (the attention ``auto`` chose, what a check interval leaves unchecked)."""
    if line in _SAID:
        return
    _SAID.add(line)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        logger.log(level, line)


def log_to_console(level: int = logging.INFO) -> None:
    """Show the ``megatron_abft`` loggers' records on the console, each as its bare message:
    notes on stdout, warnings and faults on stderr, and not again through the root logger. For
    scripts that own the console (pretrain_gpt.py); a program with a logging set-up of its own
    (Megatron-LM's) leaves this out, and with none at all Python still prints the warnings and
    faults on stderr. Calling it again changes nothing but the level."""
    logger = logging.getLogger("megatron_abft")
    logger.setLevel(level)
    logger.propagate = False
    if any(getattr(h, "megatron_abft_console", False) for h in logger.handlers):
        return
    notes, problems = logging.StreamHandler(sys.stdout), logging.StreamHandler(sys.stderr)
    notes.addFilter(lambda record: record.levelno < logging.WARNING)
    problems.setLevel(logging.WARNING)
    for handler in (notes, problems):
        handler.megatron_abft_console = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
