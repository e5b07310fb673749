"""FlashLedger: what the flash kernels found, kept on the device, in the shape of
megatron_abft.check.ledger.Ledger with a leading section dim (FLASH_SECTIONS), so that each
section's guard reads a view of it and the model-wide counters, events and policies see the flash
attention as they see the unfused one.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from megatron_abft.check.eec import KINDS, OUTCOMES
from megatron_abft.check.ledger import EVENT_FIELDS, LOG_CAPACITY, Ledger
from megatron_abft.config import FLASH_SECTIONS
from megatron_abft.flash import build
from megatron_abft.flash.launch import Findings

RECORD_BLOCK = 128
"""Matrices _record_kernel reads at a time: one shape, so that one build serves every call."""
NO_POSITION = 2**31 - 1
"""kernels.NO_ROW: the kernels store a first flagged row or column as ``NO_POSITION - row``
(0: none found)."""


@dataclass
class FlashLedger:
    """Counters and a fault log per flash section, on one device."""

    counts: Tensor
    """[sections, len(OUTCOMES), len(KINDS)] int64: matrices by outcome and kind."""
    clock: Tensor
    """[1] float64: the step a call runs at."""
    log: Tensor
    """[sections, capacity, len(EVENT_FIELDS)] float64: one record a call and section that found
    a fault: its worst matrix."""
    logged: Tensor
    """[sections] int64: the calls that found a fault since the last drain, a section."""

    @classmethod
    def on(cls, device: torch.device, step: int = 0, capacity: int = LOG_CAPACITY) -> FlashLedger:
        """An empty ledger on ``device`` whose clock reads ``step``."""
        n = len(FLASH_SECTIONS)
        return cls(
            torch.zeros(n, len(OUTCOMES), len(KINDS), dtype=torch.int64, device=device),
            torch.full((1,), float(step), dtype=torch.float64, device=device),
            torch.zeros(n, capacity, len(EVENT_FIELDS), dtype=torch.float64, device=device),
            torch.zeros(n, dtype=torch.int64, device=device),
        )

    @property
    def tensors(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return self.counts, self.clock, self.log, self.logged

    def section(self, name: str) -> Ledger:
        """The Ledger of one section: views of this ledger's tensors."""
        i = FLASH_SECTIONS.index(name)
        return Ledger(self.counts[i], self.clock, self.log[i], self.logged[i : i + 1])

    def summary(self) -> dict[str, dict[str, dict[str, int]]]:
        """``{section: {outcome: {kind: n}}}``. One host synchronisation."""
        table = self.counts.cpu().tolist()
        return {
            section: {
                outcome: dict(zip(KINDS, table[s][o], strict=True))
                for o, outcome in enumerate(OUTCOMES)
            }
            for s, section in enumerate(FLASH_SECTIONS)
        }


def record(found: Findings, counts: Tensor, clock: Tensor, log: Tensor, logged: Tensor) -> None:
    """Fold one launch's findings into a ledger's tensors, one Triton launch (a program a
    section): a matrix counts once a section, by its outcome and kind; a section that found
    something logs its worst matrix. No host synchronisation."""
    sections, matrices = found.codes.shape
    build.for_device(sys.modules[__name__], counts.device)._record_kernel[(sections,)](
        found.codes, found.rows, found.cols, counts, clock, log, logged, matrices, log.shape[1],
        len(EVENT_FIELDS), NO_POSITION, BLOCK=RECORD_BLOCK, num_warps=4, num_stages=1,
    )  # fmt: skip


@triton.jit
def _record_kernel(
    CODES, ROWS, COLS, COUNTS, CLOCK, LOG, LOGGED, BH, CAPACITY, FIELDS, NO_POSITION,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Section ``program_id``'s codes (launch.Findings) into COUNTS [3, 4] (detected, corrected,
    uncorrectable by kind), and its worst matrix into LOG when there is one."""
    s = tl.program_id(0)
    kinds = tl.arange(0, 4)
    detected = tl.zeros([4], tl.int64)
    corrected = tl.zeros([4], tl.int64)
    uncorrectable = tl.zeros([4], tl.int64)
    worst = 0
    at = 0
    for start in range(0, BH, BLOCK):
        matrix = start + tl.arange(0, BLOCK)
        code = tl.load(CODES + s * BH + matrix, mask=matrix < BH, other=0)
        of_kind = ((code & 3)[:, None] == kinds[None, :]) & (code > 0)[:, None]
        detected += tl.sum(of_kind.to(tl.int64), 0)
        corrected += tl.sum((of_kind & ((code >> 2) == 1)[:, None]).to(tl.int64), 0)
        uncorrectable += tl.sum((of_kind & ((code >> 2) == 2)[:, None]).to(tl.int64), 0)
        top = tl.max(code, 0)
        if top > worst:
            worst = top
            at = start + tl.argmax(code, 0)
    row = COUNTS + s * 12 + kinds
    tl.store(row, tl.load(row) + detected)
    tl.store(row + 4, tl.load(row + 4) + corrected)
    tl.store(row + 8, tl.load(row + 8) + uncorrectable)
    if worst > 0:
        slot = tl.load(LOGGED + s)
        if slot < CAPACITY:
            first_row = tl.load(ROWS + s * BH + at)
            first_col = tl.load(COLS + s * BH + at)
            entry = LOG + (s * CAPACITY + slot) * FIELDS
            tl.store(entry, tl.load(CLOCK))
            tl.store(entry + 1, (worst >> 2).to(tl.float64))
            tl.store(entry + 2, at.to(tl.float64))
            tl.store(entry + 3, (worst & 3).to(tl.float64))
            tl.store(entry + 4, tl.where(first_row > 0, NO_POSITION - first_row, -1).to(tl.float64))
            tl.store(entry + 5, tl.where(first_col > 0, NO_POSITION - first_col, -1).to(tl.float64))
            tl.store(entry + 6, float("nan"))
        tl.store(LOGGED + s, slot + 1)
