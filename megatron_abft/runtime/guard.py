"""SectionGuard: the check of one protected GEMM in one layer, and the model-wide views of all
guards (counters, step, layer numbers).

A protected module owns one guard per section it computes. On each forward the guard lands any
injected fault meant for it (megatron_abft.inject), then, when the section is due
(ABFTConfig.checks), has the checker it chose for the GEMM's signature
(megatron_abft.check.checker) verify and correct the output in place, or screens it inside the
kernel that reads it next (``check_read``), and tallies the outcome into its ledger, on the
device (megatron_abft.check.ledger). A fault it cannot correct is recomputed at once where that
costs no host synchronisation (CPU tensors), and otherwise left pending for the once-per-step
policy decision (megatron_abft.runtime.policy.finish_step).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

from megatron_abft.check.checker import (
    Checker,
    CompiledChecker,
    KernelCorrection,
    Reader,
    ReferenceChecker,
    choose,
    screen_key,
    signature,
)
from megatron_abft.check.checksum import Checksums
from megatron_abft.check.eec import KINDS, OUTCOMES, GemmOperands
from megatron_abft.check.ledger import EVENT_FIELDS, Ledger, drain
from megatron_abft.check.sides import NO_SCREEN, KernelSides
from megatron_abft.config import CORRECTED, SECTIONS, UNCORRECTABLE, ABFTConfig, Policy
from megatron_abft.faults import land
from megatron_abft.ops import compiled

UNCORRECTABLE_ROW = OUTCOMES.index("uncorrectable")
RECOMPUTED = 3
"""Event status of a fault that was uncorrectable in place and went away when recomputed."""
MASKED = 4
"""Event status of a fault uncorrectable in place that lay only where the softmax masks the
scores, which it overwrites: harmless."""
ACTIONS = {
    CORRECTED: "corrected",
    UNCORRECTABLE: "uncorrectable",
    RECOMPUTED: "recomputed",
    MASKED: "masked",
}
MAX_CHECKERS = 8
"""Checkers a guard keeps (megatron_abft.check.checker): one a signature it checks."""

View = Callable[[Tensor], Tensor]
"""Maps a GEMM output to the ``[..., rows, cols]`` matrix a fault section names."""
Masked = Callable[[Tensor], "Tensor | None"]
"""Maps a GEMM output to where its reader overwrites it whatever it holds (True there,
broadcastable to the output), or None where it may read every element."""


class ABFTUncorrectableError(RuntimeError):
    """A fault that ABFT could not correct, with where it happened."""

    def __init__(self, where: list[dict] | str):
        if isinstance(where, str):  # autograd re-raises an error from a hook by its message
            self.where: list[dict] = []
            super().__init__(where)
            return
        self.where = where
        places = "; ".join(
            f"rank {w['rank']} layer {w['layer']} section {w['section']} step {w['step']}"
            for w in where
        )
        super().__init__(f"ABFT: uncorrectable fault at {places}")


def collective_device(group: torch.distributed.ProcessGroup | None = None) -> torch.device:
    """Where a tensor must live for a collective on ``group``: NCCL needs the current GPU."""
    if torch.distributed.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def host_reads(config: ABFTConfig, device: torch.device) -> bool:
    """Whether a check on ``device`` may read a result on the host: always on CPU, where that
    costs nothing; elsewhere unless ``config.sync_free``, which by default (None) holds where
    the compiled kernels serve the device, as their checks settle faults on the device."""
    if torch.compiler.is_compiling():  # traced: decided on the device, as on a GPU
        return False
    if device.type == "cpu":
        return True
    if config.sync_free is None:
        return not compiled._serves_device(device)
    return not config.sync_free


def checks_apart(config: ABFTConfig, device: torch.device) -> bool:
    """Whether a GEMM's output that a kernel reads (the fused softmax reading the scores) is checked
    by its own check rather than by the reader's screen: on the CPU, where the host reads results.
    There check_gemm's screen, one call (compiled.screen_passes), reads the output again on the
    thread's workspace, which costs less host work than the reader's screen and the references
    it takes; so too the context's check against P's pass (docs/benchmarks.md, "Training-step
    overhead (CPU)")."""
    return device.type == "cpu" and host_reads(config, device)


def recompute_in_place_possible(t: Tensor) -> bool:
    """Whether a GEMM on ``t``'s device can be recomputed on demand without a host sync (not
    where torch.compile traces it: the recompute would be decided on the host)."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


class SectionGuard:
    """Checks one section (qkv, scores, context or proj) of one layer on one rank."""

    in_kernel = False
    """Whether the section's checks run inside its layer's kernels (KernelGuard)."""

    def __init__(
        self, section: str, config: ABFTConfig, tp_rank: int, fault_sections: Iterable[str] = ()
    ):
        if section not in SECTIONS:
            raise ValueError(f"unknown section {section!r}; choose from {', '.join(SECTIONS)}")
        self.section = section
        self.fault_sections = frozenset(fault_sections) or frozenset({section})
        """The fault sections (megatron_abft.faults) that can land in this guard on this rank."""
        self.config = config
        self.tp_rank = tp_rank
        self.layer: int | None = None  # Megatron's 1-based layer number, set by iter_guards
        self.step = 0
        self.faults: list = []  # model-level faults waiting to land (megatron_abft.inject)
        self.ledger: Ledger | None = None  # counters and fault log, on the device
        self.recomputed: Tensor | None = None  # GEMMs recomputed by the recompute policy
        self.harmless: Tensor | None = None  # checks whose faults lay only where masked
        self.pending: Tensor | None = None  # bool: an uncorrected fault this step
        self.recompute_failed = False  # a recomputed GEMM was still wrong this step
        self.batch_shape: tuple[int, ...] = ()  # of the checked matrices, to name heads
        self.checkers: dict[tuple, Checker] = {}  # by signature (check.checker.signature)
        self.screen: tuple[tuple, CompiledChecker] | None = None
        """(check.checker.screen_key, checker) of the last signature whose clean check ends at
        the CPU's screen (CompiledChecker.host_screen): ``verify`` asks it first, in one call
        past the guard's Python (a check's code runs with the caches cold in a step)."""

    @property
    def counts(self) -> Tensor | None:
        """[len(OUTCOMES), len(KINDS)] int64 on the device: matrices by outcome and kind."""
        return None if self.ledger is None else self.ledger.counts

    @property
    def step(self) -> int:
        """The training step the guard is on, counted from 0."""
        return self._step

    @step.setter
    def step(self, step: int) -> None:
        self._step = step
        self._on_interval = self.config.on_interval(self.section, step)

    @property
    def due(self) -> bool:
        """Whether this step checks the section (``ABFTConfig.checks``). It reads whether the
        step is on the section's interval, not the step's number, so that torch.compile
        specialises a layer on due or not due rather than compiling it again every step."""
        return self._on_interval and self.config.covers(self.section)

    def land_faults(self, output: Tensor, views: dict[str, View]) -> None:
        """Corrupt ``output`` with the waiting faults whose section is in ``views`` (callers
        skip it where none waits)."""
        self.faults = [f for f in self.faults if not land(f, self, output, views)]

    def check(
        self,
        output: Tensor,
        operands: GemmOperands,
        views: dict[str, View] | None = None,
        recompute: Callable[[], Tensor] | None = None,
        refs: tuple[Checksums, Checksums] | None = None,
        masked: Masked | None = None,
    ) -> Tensor:
        """Land faults, then verify and correct ``output = alpha * a @ b + bias`` in place,
        against ``refs`` (both sides' checksums) where given, else against checksums encoded from
        the operands. Returns the output to use: ``output`` itself, or its recomputation. Where
        the host may be read, a fault that lay only where ``masked`` says the reader overwrites
        the output is harmless (``clear_masked``)."""
        if self.faults:
            self.land_faults(output, views or {self.section: lambda t: t})
        if not self.due:
            return output
        return self.verify(output, operands, recompute, refs, masked)

    def verify(
        self,
        output: Tensor,
        operands: GemmOperands,
        recompute: Callable[[], Tensor] | None = None,
        refs: tuple[Checksums, Checksums] | None = None,
        masked: Masked | None = None,
    ) -> Tensor:
        """``check`` of a due section whose faults have landed."""
        if refs is None and self.screen is not None:
            key, checker = self.screen
            if screen_key(output, operands, self.config) == key and checker.screen(
                output, operands
            ):
                return output  # clean, as the whole path would have found
        self.batch_shape = tuple(output.shape[:-2])
        failed = self._verify(output, operands, refs)
        if failed is None:  # known clean, with no host synchronisation
            return output
        if (
            masked is not None
            and recompute is not None
            and failed is not None
            and host_reads(self.config, output.device)
            and bool(failed)
        ):
            failed = self.clear_masked(output, operands, refs, masked, recompute, failed)
        if (
            recompute is not None
            and self.config.on_uncorrectable == Policy.RECOMPUTE
            and recompute_in_place_possible(output)
            and failed is not None
            and bool(failed)
        ):
            output = recompute()
            if self.recomputed is None:
                self.recomputed = torch.zeros((), dtype=torch.int64, device=output.device)
            self.recomputed += 1
            if (again := self._verify(output, operands, refs)) is not None and bool(again):
                # still wrong: the fault is in the inputs, or persistent. Leave it pending, so
                # that finish_step raises on every rank together
                self.recompute_failed = True
            else:
                failed = torch.zeros_like(failed)
                self.ledger.amend_last(RECOMPUTED)
        if failed is not None:
            self.pending = failed if self.pending is None else self.pending | failed
        return output

    def check_read(
        self,
        output: Tensor,
        operands: GemmOperands,
        reader: Reader,
        recompute: Callable[[], Tensor] | None = None,
        masked: Masked | None = None,
    ) -> tuple[Tensor, Any]:
        """Land faults, then check ``output`` where ``reader`` reads it and return what it read
        (Reader.plain, Reader.read: for the fused softmax reading the scores, P and the context's
        references). Where the reader's kernel reads it, the check is the kernel's screen: where
        the host may be read, a flagged output is verified and corrected here and read again
        without the kernel; where it may not, the kernel corrects and tallies the flagged
        matrices itself. On the CPU (``checks_apart``) the output is checked here and then read
        by the kernel without a screen. Elsewhere the output is checked here (``check``) and
        read without the kernel."""
        if self.faults:
            self.land_faults(output, {self.section: lambda t: t})
        due = self.due
        if not reader.fuses(due):
            return reader.plain(self.check(output, operands, recompute=recompute, masked=masked))
        if not due or checks_apart(self.config, output.device):
            if due:
                output = self.check(output, operands, recompute=recompute, masked=masked)
            value, _, extra = reader.read(output, NO_SCREEN)
            return value, extra
        sides = self.screen_sides(output, operands)
        if sides is None:
            return reader.plain(self.check(output, operands, recompute=recompute, masked=masked))
        self.batch_shape = tuple(output.shape[:-2])
        ledger = self.ledger_on(output.device)
        if host_reads(self.config, output.device):
            value, flagged, extra = reader.read(output, sides)
            if bool(flagged.any()):  # corrected here, and read again from the corrected output
                return reader.plain(self.verify(output, operands, recompute, masked=masked))
            return value, extra
        a, b = operands.a, operands.b
        correction = KernelCorrection(
            (a, b, operands.alpha), self.config.near_inf, max(output.shape[-2:]), ledger
        )
        value, failed, extra = reader.read(output, sides, correction)
        self.pending = failed if self.pending is None else self.pending | failed
        return value, extra

    def clear_masked(
        self,
        output: Tensor,
        operands: GemmOperands,
        refs: tuple[Checksums, Checksums] | None,
        masked: Masked,
        recompute: Callable[[], Tensor],
        failed: Tensor,
    ) -> Tensor:
        """After a check left a matrix of ``output`` uncorrectable: give the positions its reader
        overwrites (``masked``) the GEMM's values again (``recompute``) and check once more. If
        nothing is then wrong, the faults lay only there and change nothing the layer computes:
        counted as harmless (event status MASKED), and not failed; if what is left is corrected
        in place, the event says corrected. Otherwise ``output`` is put back as it was. Returns
        whether a matrix stays uncorrectable."""
        where = masked(output)
        if where is None:
            return failed
        kept = output.clone()  # the recomputation may write into output's own buffer
        output.copy_(torch.where(where, recompute(), kept))
        scratch = Ledger.on(output.device, self.step)  # the first check already tallied it
        again = self._with_checker(
            output, operands, refs, lambda checker: checker.run(output, operands, refs, scratch)
        )
        if again is not None and bool(again):
            output.copy_(kept)
            return failed
        if bool(scratch.counts.any()):  # a fault outside the mask too, corrected this time
            self.ledger.amend_last(CORRECTED)
            return torch.zeros_like(failed)
        if self.harmless is None:
            self.harmless = torch.zeros((), dtype=torch.int64, device=output.device)
        self.harmless += 1
        self.ledger.amend_last(MASKED)
        return torch.zeros_like(failed)

    def ledger_on(self, device: torch.device) -> Ledger:
        """This guard's ledger, made on ``device`` at its first check."""
        if self.ledger is None:
            self.ledger = Ledger.on(device, self.step)
        return self.ledger

    def keep_pending(self, failed: Tensor, batch_shape: tuple[int, ...] = ()) -> None:
        """After a GEMM that checks its own output tallied what it found into this guard's
        ledger (its matrices laid out as ``batch_shape``, to name heads): ``failed``, whether a
        matrix stayed uncorrectable (a device bool), is pending for the step's policy (that GEMM
        already computed it twice)."""
        self.batch_shape = batch_shape
        self.pending = failed if self.pending is None else self.pending | failed

    def _verify(
        self, output: Tensor, operands: GemmOperands, refs: tuple[Checksums, Checksums] | None
    ) -> Tensor | None:
        """Verify and correct in place and tally, by this signature's checker (Checker.run):
        whether a matrix stayed uncorrectable (a device bool), or None where the check is known
        clean without a host synchronisation."""
        ledger = self.ledger if self.ledger is not None else self.ledger_on(output.device)
        return self._with_checker(
            output, operands, refs, lambda checker: checker.run(output, operands, refs, ledger)
        )

    def screen_sides(self, output: Tensor, operands: GemmOperands) -> KernelSides | None:
        """Both sides' references of ``output``, encoded from ``operands``, as the kernels take
        them, for a Reader's screen (Checker.sides)."""
        return self._with_checker(
            output, operands, None, lambda checker: checker.sides(output, operands)
        )

    def _with_checker(
        self,
        output: Tensor,
        operands: GemmOperands,
        refs: tuple[Checksums, Checksums] | None,
        use: Callable[[Checker], object],
    ) -> object:
        """``use`` this signature's checker. The first check of a signature takes the
        reference, which says what is wrong with bad input; then the guard keeps the checker
        ``choose`` gives for the next ones. Traced, the guard takes ``choose``'s checker and
        keeps none: a trace runs this once, and a cache it read would compile the graph again
        once filled."""
        sync_free = not host_reads(self.config, output.device)
        if torch.compiler.is_compiling():
            return use(choose(output, operands, refs, self.config, sync_free))
        key = signature(output, operands, refs, self.config, sync_free)
        checker = self.checkers.get(key)
        if checker is not None:
            if refs is None and isinstance(checker, CompiledChecker) and checker.host_screen:
                screened = screen_key(output, operands, self.config)
                self.screen = None if screened is None else (screened, checker)
            return use(checker)
        found = use(ReferenceChecker(self.config, sync_free))
        if key is not None:
            if len(self.checkers) == MAX_CHECKERS:  # shapes that keep changing: start again
                self.checkers.clear()
            self.checkers[key] = choose(output, operands, refs, self.config, sync_free)
        return found

    def where(self) -> dict:
        """Rank, layer, section and step of this guard, for error messages and events."""
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        return {
            "rank": rank,
            "tp_rank": self.tp_rank,
            "layer": self.layer,
            "section": self.section,
            "step": self.step,
        }

    def reset(self) -> None:
        """Zero the counters and empty the log, in place (a captured graph keeps writing them)."""
        if self.ledger is not None:
            self.ledger.counts.zero_()
            self.ledger.logged.zero_()
        self.recomputed = self.harmless = self.pending = None


class KernelGuard(SectionGuard):
    """A section checked and corrected inside its layer's own kernels (the flash attention):
    the guard decides what is due, holds the faults meant for it and reads what the kernels
    found from its ledger, a view of the layer's (megatron_abft.flash.FlashLedger). What the
    kernels could not correct, they already computed twice: it is pending from the moment the
    kernels count it, until the policy consumes it. ``unread``: whether the layer has run since
    the policy last read the count (the runtime's forward pre-hook sets it, eagerly even under
    torch.compile; a backward follows its forward), so that a read right after another (the
    loop's set_step after its finish_step) is left out: on a GPU each read waits for the
    device. A CUDA graph's replay would run the kernels without the hook: the layers refuse
    Megatron's CUDA graphs (layers/attention.py), and accepting them means setting it there."""

    in_kernel = True

    def __init__(self, section: str, config: ABFTConfig, tp_rank: int):
        self._uncorrectable: Tensor | None = None  # the ledger's uncorrectable counts, by kind
        self._consumed = 0  # how many of them the policy has seen
        self.unread = False
        super().__init__(section, config, tp_rank)

    @property
    def pending(self) -> Tensor | None:
        """Whether the kernels counted an uncorrectable fault since the policy last looked (a
        device bool); None before the first check."""
        if self._uncorrectable is None:
            return None
        return self._uncorrectable.sum() > self._consumed

    @pending.setter
    def pending(self, value: Tensor | None) -> None:
        """None: the policy has seen what the ledger counts now (one host read; take_pending
        reads every kernel guard's count at once instead, ``uncorrectable`` and ``consume``)."""
        if value is not None:
            raise ValueError("a kernel guard's pending faults are its ledger's; set None")
        if self._uncorrectable is not None:
            self._consumed = int(self._uncorrectable.sum())
        self.unread = False

    def attach(self, ledger: Ledger) -> None:
        """Read the kernels' findings from ``ledger``, a new one (its counts zero)."""
        self.ledger = ledger
        self._uncorrectable = ledger.counts[UNCORRECTABLE_ROW]
        self._consumed = 0
        self.unread = True

    @staticmethod
    def uncorrectable(guards: list[KernelGuard]) -> Tensor:
        """How many uncorrectable faults each of ``guards`` (attached) has counted, in one
        device tensor: one stack and one sum for all of them, where each guard's ``pending``
        takes two ops."""
        return torch.stack([g._uncorrectable for g in guards]).sum(-1)

    def consume(self, count: int) -> bool:
        """With ``count`` read from ``uncorrectable``: whether a fault is pending, now seen."""
        pending, self._consumed, self.unread = count > self._consumed, count, False
        return pending


def iter_guards(model: torch.nn.Module) -> Iterator[SectionGuard]:
    """Every guard of ``model`` in ``model.modules()`` order, with its layer number filled in
    from the outermost enclosing module that has one (Megatron's layer). One walk of the module
    tree, made before the first guard is yielded: set_step and finish_step call this every
    step. The modules seen are kept by themselves, as modules() keeps them, not by ``id()``:
    where an audit hook is installed (filelock's, which Megatron imports), every ``id()`` call
    runs it, 0.3 us and more."""
    guards: list[SectionGuard] = []
    seen: set[torch.nn.Module] = set()

    def visit(module: torch.nn.Module, layer: int | None) -> None:
        seen.add(module)  # a shared module is visited once, as modules() does
        attributes = module.__dict__  # not getattr: a missing attribute costs nn.Module a raise
        if layer is None:
            layer = attributes.get("layer_number")
        for guard in attributes.get("abft_guards", ()):
            if layer is not None and guard.layer is None:
                guard.layer = layer
            guards.append(guard)
        for child in attributes["_modules"].values():
            if child is not None and child not in seen:
                visit(child, layer)

    visit(model, None)
    return iter(guards)


def reset_stats(model: torch.nn.Module) -> None:
    """Zero every guard's counters."""
    for guard in iter_guards(model):
        guard.reset()


def stats(
    model: torch.nn.Module, group: torch.distributed.ProcessGroup | None = None
) -> dict[str, dict[str, dict[str, int]]]:
    """Counts per section the model checks (the unfused attention has no backward sections):
    ``{section: {outcome: {kind: n}}}``, with outcome in detected, corrected, uncorrectable,
    plus ``recomputed: {"gemm": n}`` and ``harmless: {"masked": n}`` (of the uncorrectable: GEMMs
    the recompute policy computed again, and checks whose faults lay only where masked). With
    ``group`` the counts are summed over its ranks in one all-reduce. One host
    synchronisation."""
    guards = list(iter_guards(model))
    checked = {g.section for g in guards}
    counted = [g.counts for g in guards if g.counts is not None]
    device = counted[0].device if counted else torch.device("cpu")
    table = torch.zeros(
        len(SECTIONS), len(OUTCOMES) + 2, len(KINDS), dtype=torch.int64, device=device
    )
    for guard in guards:  # summed on the device: one transfer at the end
        i = SECTIONS.index(guard.section)
        if guard.counts is not None:
            table[i, : len(OUTCOMES)] += guard.counts
        if guard.recomputed is not None:
            table[i, len(OUTCOMES), 0] += guard.recomputed
        if guard.harmless is not None:
            table[i, len(OUTCOMES) + 1, 0] += guard.harmless
    if group is not None:
        table = table.to(collective_device(group))
        torch.distributed.all_reduce(table, group=group)
    table = table.cpu()
    return {
        section: {
            **{
                o: dict(zip(KINDS, table[i, j].tolist(), strict=True))
                for j, o in enumerate(OUTCOMES)
            },
            "recomputed": {"gemm": int(table[i, len(OUTCOMES), 0])},
            "harmless": {"masked": int(table[i, len(OUTCOMES) + 1, 0])},
        }
        for i, section in enumerate(SECTIONS)
        if section in checked
    }


def collect_events(model: torch.nn.Module) -> list[dict]:
    """The faults every guard logged since the last call, as dicts (step, rank, tp_rank, layer,
    section, sample, head, row, col, kind, magnitude, action); empties the logs. One or two host
    synchronisations for the whole model: call it once per log interval. A guard logs at most
    ledger.LOG_CAPACITY faults in between and warns of the rest (its counters count them)."""
    guards = [g for g in iter_guards(model) if g.ledger is not None]
    events = []
    for guard, (records, unlogged) in zip(guards, drain([g.ledger for g in guards]), strict=True):
        if unlogged:
            warnings.warn(
                f"ABFT: layer {guard.layer} section {guard.section} found {unlogged} faults more "
                f"than its log keeps ({guard.ledger.capacity}) since the last collect_events: "
                "counted, not logged",
                stacklevel=2,
            )
        for record in records:
            event = dict(zip(EVENT_FIELDS, record, strict=True))
            sample, head = _sample_and_head(guard.batch_shape, int(event["matrix"]))
            events.append(
                {
                    **guard.where(),
                    "step": int(event["step"]),
                    "sample": sample,
                    "head": head,
                    "row": int(event["row"]),
                    "col": int(event["col"]),
                    "kind": KINDS[int(event["kind"])],
                    "magnitude": event["magnitude"],
                    "action": ACTIONS[int(event["status"])],
                }
            )
    return events


def _sample_and_head(batch_shape: tuple[int, ...], matrix: int) -> tuple[int, int]:
    """The micro-batch sample and the rank-local head of matrix ``matrix`` of a check whose
    matrices are laid out as ``batch_shape``: [b, groups, heads per group] for the attention
    GEMMs (head = group * heads per group + head in group), none for the linear layers."""
    if len(batch_shape) != 3:
        return -1, -1
    sample, group, member = torch.unravel_index(torch.tensor(matrix), batch_shape)
    return int(sample), int(group) * batch_shape[2] + int(member)
