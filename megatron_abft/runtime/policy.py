"""What a training step does with the faults ABFT could not correct (ABFTConfig.on_uncorrectable).

Call ``finish_step(model)`` once per step, after backward and before the optimizer step: one host
synchronisation and one tiny all-reduce decide, for all ranks together, what to do:

- ``raise``: every rank raises ABFTUncorrectableError; the faulty ranks name rank, layer, section
  and step;
- ``skip_step``: the outcome says ``skip``: discard the step's gradients;
- ``recompute``: on CPU the guard already recomputed the GEMM, and if that did not help (a fault
  in the GEMM's inputs, or a persistent one) every rank raises here; elsewhere the outcome says
  ``recompute``: run the step's forward and backward once more, then call
  ``finish_step(model, retried=True)``, which raises if the fault is still there;
- ``rerun``: decided inside the step, so that Megatron's rerun state machine re-runs it and
  attributes the fault (its exit codes 16/17 apply): where the state machine runs, the runtime
  hands it each step's faults at the end of the backward; a loop of its own calls
  ``validate_with_rerun(model)`` in its loss function;
- ``log``: print and record only.

Every uncorrectable fault is printed with rank, layer, section and step and written to the
config's events file as it is decided. A loop that calls none of this is covered by the runtime
(megatron_abft.runtime.model_runtime), which settles the faults itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_abft.config import Policy
from megatron_abft.runtime.guard import ABFTUncorrectableError, collective_device, iter_guards
from megatron_abft.runtime.model_runtime import hand_to_rerun, report, runtimes, take_pending


@dataclass(frozen=True)
class StepOutcome:
    """The policy's decision for one step, the same on every rank of ``group``."""

    action: str
    """none (nothing uncorrectable), log, skip_step or recompute."""
    where: list[dict] = field(default_factory=list)
    """This rank's uncorrectable faults: rank, tp_rank, layer, section, step."""

    @property
    def skip(self) -> bool:
        return self.action == Policy.SKIP_STEP

    @property
    def recompute(self) -> bool:
        return self.action == Policy.RECOMPUTE


def _policy(guards) -> str:
    policies = {g.config.on_uncorrectable for g in guards}
    if len(policies) > 1:
        raise ValueError(
            f"one model must use one on_uncorrectable policy, found {sorted(policies)}"
        )
    return policies.pop() if policies else Policy.LOG


LOOP_OUTCOMES = {
    Policy.RECOMPUTE: "the step is recomputed",
    Policy.RAISE: "training stops",
    Policy.SKIP_STEP: "the step is skipped",
    Policy.LOG: "logged only: training goes on with it",
}
"""What happens to an uncorrectable fault that ``finish_step`` decides, by policy."""


def finish_step(
    model: torch.nn.Module,
    group: torch.distributed.ProcessGroup | None = None,
    retried: bool = False,
) -> StepOutcome:
    """Decide what this step's uncorrectable faults mean, for all ranks of ``group`` (default:
    every rank, when torch.distributed is initialised). Clears the pending faults, and prints
    and records this rank's (megatron_abft.runtime.model_runtime.report)."""
    guards = list(iter_guards(model))
    policy = _policy(guards)
    if policy != Policy.RERUN:  # decided inside the step (validate_with_rerun, the runtime)
        for runtime in runtimes(guards):
            runtime.loop_settles = True
    where, recompute_failed = take_pending(guards)
    faults, failed_recomputes = len(where), int(recompute_failed)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size(group) > 1:
        anywhere = torch.tensor([faults, failed_recomputes], dtype=torch.int64)
        anywhere = anywhere.to(collective_device(group))
        torch.distributed.all_reduce(anywhere, group=group)
        faults, failed_recomputes = anywhere.tolist()
    if not faults:
        return StepOutcome("none")
    if policy == Policy.RERUN:
        raise RuntimeError(
            "ABFT on_uncorrectable='rerun' is decided by validate_with_rerun(model) in the loss "
            "function, inside Megatron's rerun loop, not by finish_step"
        )
    recompute_did_not_help = policy == Policy.RECOMPUTE and (retried or failed_recomputes)
    stops = policy == Policy.RAISE or recompute_did_not_help
    if where:
        report(guards[0].config, where, LOOP_OUTCOMES[Policy.RAISE if stops else policy])
    if stops:
        if where:
            raise ABFTUncorrectableError(where)
        raise ABFTUncorrectableError(
            [{"rank": "another", "tp_rank": "?", "layer": "?", "section": "?", "step": "?"}]
        )
    return StepOutcome(policy, where)


def validate_with_rerun(model: torch.nn.Module) -> None:
    """Hand this attempt's uncorrectable faults to Megatron's rerun state machine (policy rerun).
    Call it in the loss function of every attempt: it consumes the pending faults, so an in-place
    rerun is judged on its own; a fault that goes away on the rerun is diagnosed transient."""
    guards = list(iter_guards(model))
    for runtime in runtimes(guards):
        runtime.loop_settles = True
    hand_to_rerun(guards, guards[0].config if guards else None)
