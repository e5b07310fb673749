"""What Megatron's globals say about the step running now, read without importing Megatron and
without making anything: Megatron-LM's iteration, Megatron's rerun state machine while it runs
a step, the micro-batches of a step. The one module that reads Megatron's private globals; the
runtime (megatron_abft.runtime.model_runtime) asks it when the loop does not give the step."""

from __future__ import annotations

import sys


def megatron_step() -> int | None:
    """The training step as Megatron logs it (from 1), without a call from the loop: from
    Megatron-LM's ``args.curr_iteration`` where its arguments are parsed, else from the
    iteration of Megatron's rerun state machine while it runs a step (both count from 0);
    None where neither is there."""
    global_vars = sys.modules.get("megatron.training.global_vars")
    args = getattr(global_vars, "_GLOBAL_ARGS", None)
    if getattr(args, "curr_iteration", None) is not None:
        return int(args.curr_iteration) + 1
    machine = running_rerun_state_machine()
    return None if machine is None else machine.current_iteration + 1


def running_rerun_state_machine():
    """Megatron's rerun state machine while it runs a step's forward-backward, else None. Never
    makes one (``get_rerun_state_machine`` would, with a warning)."""
    module = sys.modules.get("megatron.core.rerun_state_machine")
    machine = getattr(module, "_GLOBAL_RERUN_STATE_MACHINE", None)
    if machine is None or machine.state.name == "NOT_RUNNING_YET":
        return None
    return machine


def microbatches() -> int:
    """Micro-batches a step, where Megatron's calculator knows it; else 1."""
    module = sys.modules.get("megatron.core.num_microbatches_calculator")
    calculator = getattr(module, "_GLOBAL_NUM_MICROBATCHES_CALCULATOR", None)
    return 1 if calculator is None else calculator.get()
