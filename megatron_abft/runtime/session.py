"""ABFT: the one object a training loop holds for a protected model.

Every call is optional: the protected layers are never silent without them
(megatron_abft.runtime.model_runtime). A loop that wants more holds one ``ABFT`` and calls, each
step::

    abft = ABFT(model, TelemetryConfig(events_file="out/abft_events.jsonl"))
    for iteration in range(1, train_iters + 1):
        abft.step_begin(iteration)         # check intervals and scheduled faults follow the loop
        loss = forward_backward(...)
        outcome = abft.step_end()          # the policy, for every rank together
        if outcome.recompute:               # (GPU, policy recompute) the step once more
            loss = forward_backward(...)
            outcome = abft.step_end(retried=True)
        if not outcome.skip:
            optimizer.step()
        if iteration % log_interval == 0:
            abft.log(iteration, {"lm loss": loss})
    abft.close()

For a model without protected layers every call does nothing; with ``enabled=False`` (the
layers run Megatron's own code, and only land injected faults) there is no telemetry.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from megatron_abft.config import Policy
from megatron_abft.runtime.guard import iter_guards, stats
from megatron_abft.runtime.model_runtime import set_step
from megatron_abft.runtime.policy import StepOutcome, finish_step
from megatron_abft.runtime.telemetry import Telemetry, TelemetryConfig


class ABFT:
    """The ABFT side of a training loop over ``model`` (a module, or a list of model chunks):
    steps, the per-step policy, and the telemetry."""

    def __init__(
        self,
        model: torch.nn.Module | Iterable[torch.nn.Module],
        telemetry: TelemetryConfig | None = None,
        **telemetry_options: Any,
    ):
        self.chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
        guards = [g for chunk in self.chunks for g in iter_guards(chunk)]
        self.active = bool(guards)  # faults land in a disabled model's layers too
        self.rerun = any(g.config.on_uncorrectable == Policy.RERUN for g in guards)
        enabled = any(g.config.enabled for g in guards)
        self.telemetry = Telemetry(self.chunks, telemetry, **telemetry_options) if enabled else None

    def step_begin(self, iteration: int) -> None:
        """Start step ``iteration``: settles what the last step left (megatron_abft.set_step)."""
        if self.active:
            for chunk in self.chunks:
                set_step(chunk, iteration)

    def step_end(
        self, group: torch.distributed.ProcessGroup | None = None, retried: bool = False
    ) -> StepOutcome:
        """The policy's decision for this step, the same on every rank of ``group``; raises
        where the policy says so (megatron_abft.finish_step). Call it after backward, before the
        optimizer step."""
        if not self.active or self.rerun:  # rerun is decided inside the step (the runtime)
            return StepOutcome("none")
        outcomes = [finish_step(chunk, group, retried) for chunk in self.chunks]
        acted = [o for o in outcomes if o.action != "none"]
        if not acted:
            return outcomes[0]
        return StepOutcome(acted[0].action, [w for o in acted for w in o.where])

    def count_injected(self, n: int) -> None:
        """Faults landed on this rank this step (what ``megatron_abft.inject`` yields)."""
        if self.telemetry is not None:
            self.telemetry.count_injected(n)

    def log(self, iteration: int, metrics: dict[str, float] | None = None) -> None:
        """Collective: counters and events of the interval to the console, the JSONL file and
        W&B, beside ``metrics`` (megatron_abft.runtime.telemetry.Telemetry.log)."""
        if self.telemetry is not None:
            self.telemetry.log(iteration, metrics)

    def stats(self, group: torch.distributed.ProcessGroup | None = None) -> dict:
        """Counts per section, outcome and kind (megatron_abft.stats), summed over the chunks."""
        tables = [stats(chunk, group) for chunk in self.chunks]
        first = tables[0]
        for table in tables[1:]:
            for section, outcomes in table.items():
                for outcome, kinds in outcomes.items():
                    for kind, n in kinds.items():
                        first[section][outcome][kind] += n
        return first

    def close(self, summary: dict[str, Any] | None = None) -> None:
        """Finish the telemetry: the W&B events table and summary, the JSONL file."""
        if self.telemetry is not None:
            self.telemetry.close(summary)
            self.telemetry = None
