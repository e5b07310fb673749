"""SectionGuard: the check of one protected GEMM in one layer, and the model-wide views of all
guards (counters, step, layer numbers).

A protected module owns one guard per section it computes. On each forward the guard lands any
injected fault meant for it (megatron_abft.faults.inject), then, when the section is due
(ABFTConfig.checks), encodes checksums from the GEMM's inputs, verifies and corrects the output
in place and adds the outcome to device-side counters. A fault it cannot correct is recomputed
at once where that costs no host synchronisation (CPU tensors), and otherwise left pending for
the once-per-step policy decision (megatron_abft.policy.finish_step).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
from torch import Tensor

from megatron_abft import _ext
from megatron_abft.checksum import Checksums, encode
from megatron_abft.config import SECTIONS, ABFTConfig
from megatron_abft.eec import (
    KINDS,
    OUTCOMES,
    UNCORRECTABLE,
    EECResult,
    GemmOperands,
    verify_and_correct,
)

RECOMPUTED = 3
"""Event status of a fault that was uncorrectable in place and went away when recomputed."""
ACTIONS = {1: "corrected", 2: "uncorrectable", RECOMPUTED: "recomputed"}
EVENT_FIELDS = ("step", "status", "matrix", "kind", "row", "col", "magnitude")
"""One event record per check: the worst matrix of the batch and where it went wrong."""
MAX_EVENTS = 256
"""Event records a guard keeps between two collect_events calls (SectionGuard._record)."""

View = Callable[[Tensor], Tensor]
"""Maps a GEMM output to the ``[..., rows, cols]`` matrix a fault section names."""


class ABFTUncorrectableError(RuntimeError):
    """A fault that ABFT could not correct, with where it happened."""

    def __init__(self, where: list[dict]):
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
    if device.type == "cpu":
        return True
    if config.sync_free is None:
        return not _ext._serves_device(device)
    return not config.sync_free


def recompute_in_place_possible(t: Tensor) -> bool:
    """Whether a GEMM on ``t``'s device can be recomputed on demand without a host sync."""
    return t.device.type == "cpu"


class SectionGuard:
    """Checks one section (qkv, scores, context or proj) of one layer on one rank."""

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
        self.faults: list = []  # model-level faults waiting to land (faults.inject)
        self.counts: Tensor | None = None  # [len(OUTCOMES), len(KINDS)] int64, on the device
        self.recomputed: Tensor | None = None  # GEMMs recomputed by the recompute policy
        self.pending: Tensor | None = None  # bool: an uncorrected fault this step
        self.recompute_failed = False  # a recomputed GEMM was still wrong this step
        self.events: list[Tensor] = []  # EVENT_FIELDS records of checks not known clean
        self.batch_shape: tuple[int, ...] = ()  # of the checked matrices, to name heads

    @property
    def due(self) -> bool:
        return self.config.checks(self.section, self.step)

    def land_faults(self, output: Tensor, views: dict[str, View]) -> None:
        """Corrupt ``output`` with the waiting faults whose section is in ``views``."""
        if not self.faults:
            return
        from megatron_abft.faults import land  # the model-level injector, imported lazily

        self.faults = [f for f in self.faults if not land(f, self, output, views)]

    def check(
        self,
        output: Tensor,
        operands: GemmOperands,
        views: dict[str, View] | None = None,
        recompute: Callable[[], Tensor] | None = None,
        refs: tuple[Checksums, Checksums] | None = None,
    ) -> Tensor:
        """Land faults, then verify and correct ``output = alpha * a @ b + bias`` in place,
        against ``refs`` (both sides' checksums) where given, else against checksums encoded from
        the operands. Returns the output to use: ``output`` itself, or its recomputation."""
        self.land_faults(output, views or {self.section: lambda t: t})
        if not self.due:
            return output
        return self.verify(output, operands, recompute, refs)

    def verify(
        self,
        output: Tensor,
        operands: GemmOperands,
        recompute: Callable[[], Tensor] | None = None,
        refs: tuple[Checksums, Checksums] | None = None,
    ) -> Tensor:
        """``check`` of a due section whose faults have landed."""
        self.batch_shape = tuple(output.shape[:-2])
        failed, event = self._verify(output, operands, refs)
        if (
            recompute is not None
            and self.config.on_uncorrectable == "recompute"
            and recompute_in_place_possible(output)
            and failed is not None
            and bool(failed)
        ):
            output = recompute()
            if self.recomputed is None:
                self.recomputed = torch.zeros((), dtype=torch.int64, device=output.device)
            self.recomputed += 1
            if (again := self._verify(output, operands, refs)[0]) is not None and bool(again):
                # still wrong: the fault is in the inputs, or persistent. Leave it pending, so
                # that finish_step raises on every rank together
                self.recompute_failed = True
            else:
                failed = torch.zeros_like(failed)
                event = torch.cat([event[:1], event.new_tensor([RECOMPUTED]), event[2:]])
        if event is not None:
            self._record(event)
        if failed is not None:
            self.pending = failed if self.pending is None else self.pending | failed
        return output

    def passed(self, output: Tensor) -> None:
        """Count a due check of ``output`` that a screen elsewhere found clean (the fused
        softmax's screen of the scores): nothing to correct, nothing to record."""
        self.batch_shape = tuple(output.shape[:-2])
        self._counters(output.device)

    def _counters(self, device: torch.device) -> None:
        if self.counts is None:
            self.counts = torch.zeros(len(OUTCOMES), len(KINDS), dtype=torch.int64, device=device)

    def _verify(
        self, output: Tensor, operands: GemmOperands, refs: tuple[Checksums, Checksums] | None
    ) -> tuple[Tensor | None, Tensor | None]:
        """Verify and correct in place and count. Returns whether a matrix stayed uncorrectable
        (a device bool) and the event record of the worst matrix (EVENT_FIELDS); both None when
        the check is known clean without a host synchronisation (EECResult.known_clean,
        which every clean check is where host_reads)."""
        col, row = refs or encode(
            operands.a,
            operands.b,
            alpha=operands.alpha,
            bias=operands.bias,
            block=self.config.block_size,
        )
        self._counters(output.device)
        result = verify_and_correct(
            output,
            col,
            row,
            operands=operands,
            threshold_scale=self.config.threshold_scale,
            near_inf=self.config.near_inf,
            check_references=False,
            sync_free=not host_reads(self.config, output.device),
            tally=(self.counts, self.step),
        )
        if result.known_clean:
            return None, None
        return result.tallied if result.tallied is not None else self._tally(result)

    def _tally(self, result: EECResult) -> tuple[Tensor, Tensor]:
        """Add ``result`` to the counters; whether a matrix is uncorrectable, and the event
        record. One op of the compiled kernels, else a few dozen small ones."""
        tallied = _ext.tally(result.fields, self.counts, self.step)
        if tallied is not None:
            return tallied
        self.counts += result.counts
        status = result.status.reshape(-1)
        # the first uncorrectable matrix, else the first corrected one; indexed with a 1-element
        # tensor, as a 0-d index would be read on the host (a sync on GPUs)
        worst = status.argmax().reshape(1)
        picked = [f.reshape(-1)[worst].double() for f in result.fields]
        step = torch.full((1,), float(self.step), dtype=torch.float64, device=status.device)
        event = torch.cat([step, picked[0], worst.double(), *picked[1:]])
        return (result.status == UNCORRECTABLE).any(), event

    def _record(self, event: Tensor) -> None:
        """Keep ``event`` until collect_events. A sync-free check on a GPU records one per check,
        clean or not, as it cannot read which; at MAX_EVENTS records the list is cut, on the
        device, to the half with the worst statuses, in their order (the counters stay exact)."""
        self.events.append(event)
        if len(self.events) >= MAX_EVENTS:
            table = torch.stack(self.events)
            worst = table[:, 1].topk(MAX_EVENTS // 2, sorted=False).indices.sort().values
            self.events = list(table[worst].unbind())

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
        self.counts = self.recomputed = self.pending = None
        self.events = []


def iter_guards(model: torch.nn.Module) -> Iterator[SectionGuard]:
    """Every guard of ``model``, with its layer number filled in from the enclosing layer."""
    for module in model.modules():
        layer = getattr(module, "layer_number", None)
        for child in module.modules():
            for guard in getattr(child, "abft_guards", ()):
                if layer is not None and guard.layer is None:
                    guard.layer = layer
    for module in model.modules():
        yield from getattr(module, "abft_guards", ())


def set_step(model: torch.nn.Module, step: int) -> None:
    """Tell every guard the training step, which decides what is due (check intervals) and
    which injected faults land."""
    for guard in iter_guards(model):
        guard.step = step
        guard.pending = None
        guard.recompute_failed = False


def reset_stats(model: torch.nn.Module) -> None:
    """Zero every guard's counters."""
    for guard in iter_guards(model):
        guard.reset()


def stats(
    model: torch.nn.Module, group: torch.distributed.ProcessGroup | None = None
) -> dict[str, dict[str, dict[str, int]]]:
    """Counts per section: ``{section: {outcome: {kind: n}}}``, with outcome in detected,
    corrected, uncorrectable, plus ``recomputed: {"gemm": n}``. With ``group`` the counts are
    summed over its ranks in one all-reduce. One host synchronisation."""
    guards = list(iter_guards(model))
    counted = [g.counts for g in guards if g.counts is not None]
    device = counted[0].device if counted else torch.device("cpu")
    table = torch.zeros(
        len(SECTIONS), len(OUTCOMES) + 1, len(KINDS), dtype=torch.int64, device=device
    )
    for guard in guards:  # summed on the device: one transfer at the end
        i = SECTIONS.index(guard.section)
        if guard.counts is not None:
            table[i, : len(OUTCOMES)] += guard.counts
        if guard.recomputed is not None:
            table[i, len(OUTCOMES), 0] += guard.recomputed
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
        }
        for i, section in enumerate(SECTIONS)
    }


def collect_events(model: torch.nn.Module) -> list[dict]:
    """The faults every guard saw since the last call, as dicts (step, rank, tp_rank, layer,
    section, sample, head, row, col, kind, magnitude, action); clears them. One host
    synchronisation for the whole model: call it once per log interval. A guard keeps at most
    MAX_EVENTS records in between; past that, the worst half (by action) of what it has."""
    guards = [g for g in iter_guards(model) if g.events]
    if not guards:
        return []
    table = torch.cat([torch.stack(g.events) for g in guards]).cpu().tolist()
    events, start = [], 0
    for guard in guards:
        rows, start = table[start : start + len(guard.events)], start + len(guard.events)
        guard.events = []
        for record in rows:
            event = dict(zip(EVENT_FIELDS, record, strict=True))
            if event["status"] == 0:
                continue
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
