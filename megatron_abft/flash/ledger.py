"""FlashLedger: what the flash kernels found, kept on the device, in the shape of
megatron_abft.check.ledger.Ledger with a leading section dim (FLASH_SECTIONS), so that each
section's guard reads a view of it and the model-wide counters, events and policies see the flash
attention as they see the unfused one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_abft.check.eec import KINDS, OUTCOMES
from megatron_abft.check.ledger import EVENT_FIELDS, LOG_CAPACITY, Ledger
from megatron_abft.config import FLASH_SECTIONS


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
