"""Ledger: what one guard's checks found, kept on the device: counters by outcome and kind, a
log of the checks that found a fault, and the step they ran at.

A check's tally writes all of it without a host read: one op of the compiled kernels
(megatron_abft::tally, or the correction's own launch in verify_correct_tally), else a few
dozen PyTorch ops. Nothing of it lives on the host, so a check captured in a CUDA graph logs
what each replay finds, at the step of that replay: the step is read from the ledger's clock,
which ``set_clocks`` moves on outside the graph. The log keeps the first ``capacity`` records
between two drains and counts the rest; the counters are exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from megatron_abft.config import KINDS, OUTCOMES, UNCORRECTABLE
from megatron_abft.ops import compiled

EVENT_FIELDS = ("step", "status", "matrix", "kind", "row", "col", "magnitude")
"""One log record: the worst matrix of a check that found a fault, and where it went wrong."""
LOG_CAPACITY = 64
"""Records a ledger keeps between two drains (guard.collect_events, once per log interval)."""


class Found(Protocol):
    """What a check found, as ``Ledger.tally`` reads it (megatron_abft.check.eec.EECResult)."""

    counts: Tensor
    status: Tensor

    @property
    def fields(self) -> tuple[Tensor, ...]: ...


@dataclass
class Ledger:
    """A guard's device-side record. All on one device."""

    counts: Tensor
    """[len(OUTCOMES), len(KINDS)] int64: matrices by outcome and kind."""
    clock: Tensor
    """[1] float64: the step a check runs at."""
    log: Tensor
    """[capacity, len(EVENT_FIELDS)] float64: the records of the checks that found a fault."""
    logged: Tensor
    """[1] int64: the checks that found a fault since the last drain, kept in the log or not."""

    @classmethod
    def on(cls, device: torch.device, step: int, capacity: int = LOG_CAPACITY) -> Ledger:
        """An empty ledger on ``device`` whose clock reads ``step``."""
        if capacity < 1:
            raise ValueError(f"a ledger keeps at least one log record, not {capacity}")
        return cls(
            torch.zeros(len(OUTCOMES), len(KINDS), dtype=torch.int64, device=device),
            torch.full((1,), float(step), dtype=torch.float64, device=device),
            torch.zeros(capacity, len(EVENT_FIELDS), dtype=torch.float64, device=device),
            torch.zeros(1, dtype=torch.int64, device=device),
        )

    @property
    def capacity(self) -> int:
        return self.log.shape[0]

    def tally(self, result: Found) -> Tensor:
        """Add what a check found to the ledger; whether a matrix stayed uncorrectable (a bool
        tensor). One op of the compiled kernels, else its PyTorch twin."""
        failed = compiled.tally(result.fields, self)
        if failed is not None:
            return failed
        self.counts += result.counts
        status = result.status.reshape(-1)
        # the first uncorrectable matrix, else the first corrected one; indexed with a 1-element
        # tensor, as a 0-d index would be read on the host (a sync on GPUs)
        worst = status.argmax().reshape(1)
        picked = [f.reshape(-1)[worst].double() for f in result.fields]
        record = torch.cat([self.clock, picked[0], worst.double(), *picked[1:]])
        found = picked[0] != 0
        slot = self.logged.clamp(max=self.capacity - 1)
        kept = torch.where(found & (self.logged < self.capacity), record, self.log[slot])
        self.log.index_copy_(0, slot, kept)
        self.logged += found
        return (result.status == UNCORRECTABLE).any()

    def amend_last(self, status: int) -> None:
        """Set the status of the last record kept, if the last fault found was kept. Reads
        ``logged`` on the host: for checks that may (a recomputation on the CPU)."""
        n = int(self.logged)
        if 0 < n <= self.capacity:
            self.log[n - 1, EVENT_FIELDS.index("status")] = status


def set_clocks(ledgers: list[Ledger], step: int) -> None:
    """Set every ledger's clock to ``step``: two multi-tensor ops a device."""
    by_device: dict[torch.device, list[Tensor]] = {}
    for ledger in ledgers:
        clocks = by_device.setdefault(ledger.clock.device, [])
        if not clocks or clocks[-1] is not ledger.clock:  # a flash layer's guards share one
            clocks.append(ledger.clock)
    for clocks in by_device.values():
        torch._foreach_zero_(clocks)
        torch._foreach_add_(clocks, float(step))


def drain(ledgers: list[Ledger]) -> list[tuple[list[list[float]], int]]:
    """Each ledger's log records since the last drain (EVENT_FIELDS lists, in the order they were
    written) and how many faults it found past its capacity; empties the logs. One host read of
    the counts, and one of the records if there are any."""
    if not ledgers:
        return []
    home = ledgers[0].logged.device
    logged = torch.cat([ledger.logged.to(home) for ledger in ledgers]).tolist()
    kept = [min(n, ledger.capacity) for n, ledger in zip(logged, ledgers, strict=True)]
    if not any(kept):
        return [([], 0) for _ in ledgers]
    table = torch.cat(
        [ledger.log[:n].to(home) for n, ledger in zip(kept, ledgers, strict=True) if n]
    ).tolist()
    drained, start = [], 0
    for n, k, ledger in zip(logged, kept, ledgers, strict=True):
        drained.append((table[start : start + k], n - k))
        start += k
        if n:
            ledger.logged.zero_()
    return drained
