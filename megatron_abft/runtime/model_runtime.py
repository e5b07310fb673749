"""The ABFT runtime of a model: what keeps the promise "never silent" when the training loop makes
no ABFT call.

Every protected layer built from one ``ABFTConfig`` attaches to that config's runtime
(``runtime_of``). The runtime sees each protected forward through a forward pre-hook, and so
knows when a new pass over the model begins (the first protected module runs again) and, with
the step, when a new step does. There it settles what nothing consumed: every fault still
uncorrectable is printed with rank, layer, section and step, written to the config's events
file, and handed to the policy; a loop that calls ``set_step`` settles there instead, once a
step. Where Megatron's train_step runs the pass (its rerun state machine is running) and the
loop neither drives the steps nor consumes the faults (``finish_step``, ``validate_with_rerun``),
the runtime settles earlier, at the end of the step's last backward (a gradient hook on the
first protected module's input): still inside Megatron's forward-backward and before the
optimizer step, where the rerun state machine can re-run the step.

The step decides check intervals and scheduled faults. The loop gives it with ``set_step``;
otherwise the runtime reads Megatron-LM's iteration or, failing that, the iteration of Megatron's
rerun state machine while it runs a step. Where no step is known the runtime counts passes, and
a config or a fault that needs the real step is refused at the second pass. The runtime lands
the faults of a plan at their steps (Megatron-LM's ``--abft-inject``); ``inject`` arms faults in
a model for one block of the loop.

Where the loop makes no telemetry call either (Megatron-LM's), the runtime logs the guards'
counters every few steps from the end of the optimizer's step (torch's global optimizer hook):
there every rank has left the step's forward-backward, so the gather's collective cannot wait
on a pipeline peer that waits on it.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import socket
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from megatron_abft.check.ledger import set_clocks
from megatron_abft.config import ABFTConfig, Policy
from megatron_abft.faults import Fault, arm, disarm
from megatron_abft.runtime.guard import (
    ABFTUncorrectableError,
    KernelGuard,
    SectionGuard,
    iter_guards,
)
from megatron_abft.runtime.megatron_state import (
    megatron_step,
    microbatches,
    running_rerun_state_machine,
)

_log = logging.getLogger(__name__)

WITHOUT_LOOP = {
    Policy.RECOMPUTE: "raised (the recompute did not help, or needs the loop's finish_step)",
    Policy.RAISE: "raised",
    Policy.SKIP_STEP: "raised (skipping a step needs the loop's finish_step)",
    Policy.RERUN: "raised (found after its step, too late for Megatron's rerun)",
    Policy.LOG: "logged only: training goes on with it",
}
"""What the runtime does with an uncorrectable fault that the loop left to it, by policy."""


_RUNTIMES: dict[int, Runtime] = {}
"""Each config's runtime, by the config's id: the config stays plain data. A runtime holds its
config weakly and leaves this table when the config goes, so an id names one config."""


def runtime_of(config: ABFTConfig) -> Runtime:
    """The runtime shared by every layer built from ``config``, made at the first call and kept
    while ``config`` lives."""
    runtime = _RUNTIMES.get(id(config))
    if runtime is None:
        runtime = Runtime(config)
    return runtime


def runtimes(guards: Iterable[SectionGuard]) -> list[Runtime]:
    """The runtimes of ``guards``' configs, each once: looked up once a run of guards of one
    config (the ``id()`` of a lookup runs any audit hook installed, iter_guards)."""
    found: dict[Runtime, None] = {}
    config = None
    for guard in guards:
        if guard.config is not config:
            config = guard.config
            found[runtime_of(config)] = None
    return list(found)


def in_backward() -> bool:
    """Whether autograd is running a backward pass (a recomputed forward runs inside one)."""
    return torch._C._current_graph_task_id() != -1


def take_pending(guards: list[SectionGuard]) -> tuple[list[dict], bool]:
    """Where ``guards`` hold an uncorrectable fault (rank, layer, section, step each), and
    whether a recompute failed; clears both. One host read, none when nothing is pending (a
    kernel guard's count is read where its layer has run since it was last read)."""
    kernel = [g for g in guards if g.in_kernel and g.ledger is not None and g.unread]
    held = [g for g in guards if not g.in_kernel and g.pending is not None]
    parts = [torch.stack([g.pending for g in held]).long()] if held else []
    if kernel:  # the flash layers' seven guards each: their counts in one stack
        parts.append(KernelGuard.uncorrectable(kernel))
    read = torch.cat(parts).tolist() if parts else []
    hits = dict(zip(held, map(bool, read[: len(held)]), strict=True))
    hits.update((g, g.consume(n)) for g, n in zip(kernel, read[len(held) :], strict=True))
    where = [g.where() for g in guards if hits.get(g)]
    recompute_failed = any(g.recompute_failed for g in guards)
    for guard in guards:
        if not guard.in_kernel:  # a kernel guard's pending is its ledger's, consumed above
            guard.pending = None
        guard.recompute_failed = False
    return where, recompute_failed


def fault_line(where: dict, outcome: str) -> str:
    """The console line of a fault not corrected in place (rank, step, layer and section of
    ``where``), in Megatron's fault-log style, with what was done about it."""
    return (
        f"!!! ABFT UNCORRECTABLE FAULT !!! Rank {where['rank']}, node {socket.gethostname()}, "
        f"iteration {where['step']}: layer {where['layer']} section {where['section']}; {outcome}"
    )


def report(config: ABFTConfig, where: list[dict], outcome: str) -> None:
    """Log each uncorrectable fault of ``where`` as an error, at once: the one line a fault
    gets (a Telemetry prints only the faults it alone sees, recomputed or masked), on stderr
    where no logging is set up. Append it to ``config.events_file`` (a JSON line each), unless
    a Telemetry writes the events."""
    if not where:
        return
    for w in where:
        _log.error(fault_line(w, f"policy {config.on_uncorrectable}: {outcome}"))
    path = config.events_file
    if path and not runtime_of(config).telemetry_writes_events:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "a") as events:
            for w in where:
                record = {**w, "action": "uncorrectable", "policy": config.on_uncorrectable}
                events.write(json.dumps(record) + "\n")


def hand_to_rerun(guards: list[SectionGuard], config: ABFTConfig) -> None:
    """Hand this attempt's uncorrectable faults of ``guards`` to Megatron's rerun state machine,
    which re-runs the step in place (policy rerun). Call it once in every attempt, clean or
    not: the machine matches an attempt's validations with the first attempt's by order."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    where, _ = take_pending(guards)
    report(config, where, "handed to Megatron's rerun state machine")
    device = next((g.ledger.counts.device for g in guards if g.ledger is not None), None)
    count = torch.tensor(float(len(where)), device=device)
    get_rerun_state_machine().validate_result(
        result=count,
        rejection_func=lambda c: bool(c > 0),
        message="ABFT: uncorrectable fault in a protected attention GEMM",
        tolerance=0.0,
        fatal=True,
    )


class Runtime:
    """The protected modules of one config: their guards, the pass they run in, the step, and
    the settling of the faults no one else consumed."""

    def __init__(self, config: ABFTConfig):
        self._register(config)
        self._modules: list[weakref.ref] = []
        self._layer: int | None = None  # the layer of the last core attention attached
        self._ran: weakref.WeakSet = weakref.WeakSet()  # the modules that ran in this pass
        self.passes = 0
        self.step: int | None = None
        self._backward_ends = 0  # backward passes settled or counted in this step
        self.step_from_loop = False  # set_step was called
        self.loop_settles = False  # finish_step or validate_with_rerun was called
        self.telemetry_writes_events = False  # a Telemetry writes the events file
        self.fault_plan = None
        """Faults to land by step, where the loop does not inject them (Megatron-LM's
        ``--abft-inject``): anything with ``at(step) -> list[Fault]`` and ``active``."""
        self.landed: list[dict] = []  # where the plan's faults landed on this rank
        self._armed: list[SectionGuard] = []
        self.log_every: int | None = None  # steps between the runtime's own telemetry logs
        self._make_telemetry: Callable[[list[torch.nn.Module]], Any] | None = None
        self.telemetry: Any = None  # the runtime's own Telemetry, made at its first log
        self.loop_logs = False  # the loop made a Telemetry of these guards: it logs
        self._logged_step: int | None = None
        self._optimizer_hook = None
        atexit.register(_settle_at_exit, weakref.ref(self))

    def _register(self, config: ABFTConfig) -> None:
        """Be ``config``'s runtime (runtime_of) for as long as ``config`` lives."""
        self._config = weakref.ref(config)
        _RUNTIMES[id(config)] = self
        weakref.finalize(config, _RUNTIMES.pop, id(config), None)

    @property
    def config(self) -> ABFTConfig:
        config = self._config()
        if config is None:  # its layers hold it: only a runtime kept past its model sees this
            raise RuntimeError("the ABFTConfig of this runtime no longer exists")
        return config

    def __getstate__(self) -> dict:  # a pickled model keeps its runtime: weak refs cannot go
        state = self.__dict__.copy()
        state["_config"] = self.config
        state["_modules"] = [m for m in (ref() for ref in self._modules) if m is not None]
        state["_ran"] = list(self._ran)
        # a copy logs nothing by itself: the hook and the telemetry belong to this process
        state.update(log_every=None, _make_telemetry=None, telemetry=None, _optimizer_hook=None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._register(state["_config"])
        self._modules = [weakref.ref(m) for m in state["_modules"]]
        self._ran = weakref.WeakSet(state["_ran"])
        atexit.register(_settle_at_exit, weakref.ref(self))

    def attach(self, module: torch.nn.Module) -> None:
        """Take ``module``'s guards (``module.abft_guards``) into the runtime and watch its
        forward. Megatron builds a layer's core attention, then its projections: a guard of a
        module without a ``layer_number`` takes the last one attached."""
        layer = getattr(module, "layer_number", None)
        if layer is not None:
            self._layer = layer
        for guard in module.abft_guards:
            if guard.layer is None:
                guard.layer = self._layer
        self._modules.append(weakref.ref(module))
        module.register_forward_pre_hook(_EagerHook(self))

    def guards(self) -> Iterator[SectionGuard]:
        """The guards of the attached modules still alive, in the order they attached."""
        for ref in self._modules:
            module = ref()
            if module is not None:
                yield from module.abft_guards

    # --- passes and steps ------------------------------------------------------------------------

    def _before_forward(self, module: torch.nn.Module, args: tuple) -> None:
        for guard in module.abft_guards:  # the kernels may count from here on
            if guard.in_kernel:
                guard.unread = True
        if in_backward():  # activation recomputation: the same pass
            return
        if not self._ran or module in self._ran:
            self._begin_pass()
            self._watch_backward(args)
        self._ran.add(module)

    def _begin_pass(self) -> None:
        """A new pass over the model: where it starts a new step, settle what the last step
        left and move to the new one. A loop that calls ``set_step`` settles there instead."""
        self._ran.clear()
        self.passes += 1
        if self.step_from_loop:
            return
        step = megatron_step()
        if step is None:
            if self.passes > 1:  # the loop had one pass to call set_step
                self._refuse_without_step()
            step = self.passes - 1
        if step != self.step:
            self.settle()
            self.move_to(step)

    def _watch_backward(self, args: tuple) -> None:
        """Settle at the end of this pass's backward, when the gradient reaches the first
        protected module's input, where Megatron's train_step runs the pass and the loop neither
        drives the steps nor consumes the faults. A loop of its own may call ``finish_step``
        after backward: there the next pass settles what is left."""
        if not self._settles_after_backward() or not torch.is_grad_enabled():
            return
        if running_rerun_state_machine() is None:  # not Megatron's train_step: a loop of its own
            return
        for arg in args:
            if isinstance(arg, torch.Tensor) and arg.requires_grad:
                arg.register_hook(self._after_backward)
                return

    def _settles_after_backward(self) -> bool:
        """Whether the end of a backward is the runtime's to settle: unless the loop consumes
        the faults itself, or, but for policy rerun (decided inside the step), drives steps."""
        if self.loop_settles:
            return False
        return self.config.on_uncorrectable == Policy.RERUN or not self.step_from_loop

    def _after_backward(self, grad: torch.Tensor) -> None:
        if not self._settles_after_backward():
            return
        self._backward_ends += 1
        if self._backward_ends % microbatches():  # the step's last micro-batch settles
            return
        if self.config.on_uncorrectable == Policy.RERUN:
            hand_to_rerun(list(self.guards()), self.config)
        else:
            self.settle()

    def _refuse_without_step(self) -> None:
        """Raise if something needs the training step where none is known."""
        config = self.config
        sparse = {s: n for s in config.sections if (n := config.interval(s)) > 1 and config.enabled}
        scheduled = sorted({a.fault.step for g in self.guards() for a in g.faults} - {None})
        if sparse:
            needs = f"check intervals {sparse}"
        elif scheduled:
            needs = f"faults at steps {scheduled}"
        elif self.fault_plan is not None and self.fault_plan.active:
            needs = "faults planned by step (--abft-inject)"
        else:
            return
        raise RuntimeError(
            f"ABFT: {needs} need the training step, and none is known: call "
            "megatron_abft.set_step(model, iteration) at the start of every step, or train "
            "with Megatron-LM, whose iteration the runtime reads"
        )

    def move_to(self, step: int) -> None:
        """Move to ``step``, and arm the faults the plan holds for it."""
        if step == self.step:
            return
        self.step = step
        self._backward_ends = 0
        guards = list(self.guards())
        move_to_step(guards, step)
        if self.fault_plan is not None:
            disarm(self._armed, self.landed)
            layers = {g.layer for g in guards}
            due = [f for f in self.fault_plan.at(step) if f.layer in (None, *layers)]
            self._armed = arm(guards, due, self.landed)

    def settle(self) -> None:
        settle(list(self.guards()), self.config)

    # --- telemetry without loop calls ------------------------------------------------------------

    def log_at_optimizer_steps(
        self, every: int, make: Callable[[list[torch.nn.Module]], Any]
    ) -> None:
        """Log the guards' telemetry every ``every`` steps, at the end of the optimizer's step,
        where the loop makes no telemetry call: ``make(modules)`` builds the Telemetry (of the
        attached modules) at the first log, and each log is its collective ``log(step)``. Every
        rank steps its optimizer every step (all skip together where Megatron skips one), so
        every rank logs the same steps. A loop that makes a Telemetry of these guards takes over
        (``loop_logs``)."""
        self.log_every, self._make_telemetry = every, make
        if self._optimizer_hook is None:
            hook = _optimizer_stepped(weakref.ref(self))
            self._optimizer_hook = register_optimizer_step_post_hook(hook)

    def _log_step(self) -> None:
        """After an optimizer's step: log where a log is due (once a step, however many
        optimizers the step has). The step is Megatron-LM's where it is known, so that a rank
        whose stage holds no protected layer (and sees no protected forward) logs with the
        others: the log is a collective."""
        step = megatron_step()
        step = self.step if step is None else step
        if self.log_every is None or self.loop_logs or step is None:
            return
        if step % self.log_every or step == self._logged_step:
            return
        self._logged_step = step
        if self.telemetry is None:
            modules = [m for m in (ref() for ref in self._modules) if m is not None]
            self.telemetry = self._make_telemetry(modules)
            self.loop_logs = False  # that Telemetry is the runtime's own, not the loop's
        self.telemetry.log(step)


class _EagerHook:
    """A runtime's forward pre-hook, which torch.compile runs eagerly: host bookkeeping that,
    traced, would specialise a graph on every step. The runtime's method is disabled here, not
    where it is defined, since torch._dynamo imports Triton; called outside a trace it runs
    as it is (the disabled wrapper costs about 2 us a call); pickled, the hook is its
    runtime's."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self._traced = torch.compiler.disable(runtime._before_forward)

    def __call__(self, module: torch.nn.Module, args: tuple) -> None:
        if torch.compiler.is_compiling():
            self._traced(module, args)
        else:
            self.runtime._before_forward(module, args)

    def __reduce__(self) -> tuple:
        return _EagerHook, (self.runtime,)


def _optimizer_stepped(ref: weakref.ref) -> Callable:
    """torch's global optimizer post-hook for the runtime ``ref`` (a weak reference: the hook
    must not keep a model's runtime alive)."""

    def hook(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        runtime = ref()
        if runtime is not None:
            runtime._log_step()

    return hook


def move_to_step(guards: list[SectionGuard], step: int) -> None:
    """Put ``guards`` and their ledgers' clocks on training step ``step``."""
    for guard in guards:
        guard.step = step
    set_clocks([g.ledger for g in guards if g.ledger is not None], step)


def settle(guards: list[SectionGuard], config: ABFTConfig) -> None:
    """Print, record and hand to ``config``'s policy every fault of ``guards`` still
    uncorrectable, as far as the policy can act without the loop (WITHOUT_LOOP)."""
    where, _ = take_pending(guards)
    if not where:
        return
    report(config, where, WITHOUT_LOOP[config.on_uncorrectable])
    if config.on_uncorrectable != Policy.LOG:
        raise ABFTUncorrectableError(where)


def set_step(model: torch.nn.Module, step: int) -> None:
    """Tell every guard of ``model`` the training step, which decides what is due (check
    intervals) and which injected faults land, and is the step their ledgers log faults at.
    First settles what the last step left unconsumed (``settle``): nothing is dropped."""
    guards = list(iter_guards(model))
    if guards:
        settle(guards, guards[0].config)
    for runtime in runtimes(guards):
        runtime.step_from_loop = True
        runtime.move_to(step)  # with the faults its plan holds for the step
    move_to_step([g for g in guards if g.step != step], step)  # those no runtime moved


def _settle_at_exit(ref: weakref.ref) -> None:
    """Print and record what the last pass of a run left, which no next pass will settle."""
    runtime = ref()
    if runtime is not None:
        where, _ = take_pending(list(runtime.guards()))
        if where:  # from live guards, whose config lives too
            report(runtime.config, where, "found in the last pass: printed and recorded only")


@contextlib.contextmanager
def inject(model: torch.nn.Module, faults: list[Fault]) -> Iterator[list[dict]]:
    """Arm ``faults`` in ``model``'s protected layers for the duration of the block. Each lands
    after its GEMM and before its verification, on the named layer and tensor-parallel rank,
    once (a persistent one, in the flash kernels, in every computation of its call). Yields the
    list of landings (rank, layer, section, step, kind, position)."""
    log: list[dict] = []
    armed_in = arm(list(iter_guards(model)), faults, log)
    try:
        yield log
    finally:
        disarm(armed_in, log)
