"""ABFTConfig: what is protected, how often, how strictly, and what happens when a fault
cannot be corrected. A dataclass in Megatron-core's style: a docstring under each field and
validation in ``__post_init__``."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

import torch

FORWARD_SECTIONS: tuple[str, ...] = ("qkv", "scores", "context", "proj")
"""The checked forward GEMMs of one attention layer, in the order they run (docs/megatron.md,
"What is checked"): checked by the unfused and the flash attention alike."""

BACKWARD_SECTIONS: tuple[str, ...] = ("bwd_scores", "grad_probs", "grad_v", "grad_k", "grad_q")
"""The checked backward GEMMs of the flash attention (megatron_abft.flash): the recomputed
scores S, dP = dO V^T, dV = P^T dO, dK = dS^T Q and dQ = dS K."""

SECTIONS: tuple[str, ...] = FORWARD_SECTIONS + BACKWARD_SECTIONS
"""Every checked section. The unfused attention checks the forward ones."""

FLASH_SECTIONS: tuple[str, ...] = ("scores", "context") + BACKWARD_SECTIONS
"""The sections the flash kernels check, in their order (megatron_abft.flash.kernels)."""

ATTENTIONS: tuple[str, ...] = ("auto", "flash", "unfused")
"""The protected core attentions a layer spec can take (megatron_abft.spec): the flash kernels
(megatron_abft.flash), the unfused attention, or flash where the kernels compile for the GPU."""


class Policy(StrEnum):
    """What to do with a fault that cannot be corrected in place (docs/megatron.md, "When a
    fault cannot be corrected"). A str: ``Policy.RERUN == "rerun"``."""

    RECOMPUTE = "recompute"
    RAISE = "raise"
    SKIP_STEP = "skip_step"
    RERUN = "rerun"
    LOG = "log"


POLICIES: tuple[str, ...] = tuple(p.value for p in Policy)
"""The policies by name (command-line choices)."""

KINDS: tuple[str, ...] = ("finite", "near_inf", "inf", "nan")
"""Kinds of fault, by the worst checksum difference a matrix showed."""

OUTCOMES: tuple[str, ...] = ("detected", "corrected", "uncorrectable")
"""What a check counts of a matrix it flagged."""

CLEAN, CORRECTED, UNCORRECTABLE = 0, 1, 2
"""A checked matrix's status: nothing found, corrected in place, or not."""

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
"""The data types a protected model runs in, by the names the tools and flags use."""

DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}
"""DTYPES the other way round: a dtype's name in flags, reports and Triton signatures."""


def _bad(field_name: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"ABFTConfig.{field_name}: {value!r} is not allowed; {allowed}")


@dataclass
class ABFTConfig:
    """Configuration of algorithm-based fault tolerance for Megatron-core attention."""

    enabled: bool = True
    """Check and correct the protected GEMMs. With False the protected layers behave exactly as
    Megatron's own."""

    sections: tuple[str, ...] = SECTIONS
    """Which GEMMs are checked: a subset of SECTIONS (qkv, scores, context, proj, and the flash
    attention's backward bwd_scores, grad_probs, grad_v, grad_k, grad_q). A comma-separated
    string is accepted too."""

    check_interval: int | Mapping[str, int] = 1
    """Check a section on every N-th step (1 = every step). Either one int for all sections or a
    mapping from section to int; sections missing from the mapping are checked every step."""

    block_size: int = 256
    """Length of the checksum blocks along a checked dimension. Shorter blocks detect smaller
    errors and locate them more reliably, at the cost of more checksum rows (docs/abft.md)."""

    threshold_scale: float = 1.0
    """Multiplies every detection threshold. The default 1.0 keeps the rigorous rounding-error
    bound of docs/abft.md (no false alarms by construction); below 1 trades false alarms for a
    lower detection limit."""

    near_inf: float = 1e10
    """Magnitude above which a finite value counts as extreme (ATTNChecker's near-INF). Only used
    to locate a fault when the checksum differences themselves overflow."""

    sync_free: bool | None = None
    """Whether a check may read a value on the host. True: never, so that checks can be
    captured in CUDA graphs; with the compiled kernels a check is then three ops that also
    correct on the device, and a matrix they cannot settle (more than a 1D fault, or more flagged
    vectors than a pass takes) counts as uncorrectable, for ``on_uncorrectable``; without them
    the PyTorch correction path runs on every check on a GPU, fault or not: many small kernels.
    False: a GPU synchronises once per check, to hand what the kernels could not settle to the
    PyTorch path (megatron_abft.check.eec), or without them to skip that path when the check is
    clean. None (default): True where the compiled kernels serve the GPU, else False
    (megatron_abft.runtime.guard.host_reads). On CPUs reading costs nothing and always happens."""

    fused_softmax: bool = True
    """Compute the attention softmax in one compiled op, the fused softmax
    (megatron_abft.ops.fused_softmax), where the compiled kernels apply: the scores' check and
    the context's checksum pass then ride on the softmax's one read of the scores. Its probabilities
    equal Megatron's softmax to rounding (a few units in the last place), not bit for bit; False
    keeps Megatron's softmax, and a clean protected run bit for bit equal to an unprotected one."""

    checked_gemm: bool = False
    """Compute the QKV and output projections, and the unfused attention's scores and context,
    with the checked GEMM (megatron_abft.ops.checked_gemm: a Triton GEMM that checks each output
    tile in its own epilogue and computes a flagged tile again) instead of Megatron's GEMMs and
    checks that read their outputs again, where it serves: bf16 and fp16 on a GPU, and CPU
    tensors through Triton's interpreter (slowly). A section with a fault to land takes
    Megatron's GEMM and the usual check. Off by default until a GPU run has timed it against
    cuBLAS (docs/abft.md §9)."""

    on_uncorrectable: Policy = Policy.RECOMPUTE
    """Policy for a fault that cannot be corrected in place: recompute (run the work once more,
    then raise), raise, skip_step (discard the step's gradients), rerun (hand over to Megatron's
    rerun state machine) or log (count only)."""

    events_file: str | None = "abft_events.jsonl"
    """JSON Lines file each rank appends its uncorrectable faults to as they are decided (rank,
    layer, section, step, policy); None: printed only. A Telemetry with an events file of its
    own writes every event there instead (megatron_abft.runtime.telemetry)."""

    _intervals: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("enabled", "fused_softmax", "checked_gemm"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, getattr(self, name), "use True or False")
        if self.sync_free is not None and not isinstance(self.sync_free, bool):
            raise _bad("sync_free", self.sync_free, "use True, False or None (by device)")
        self.sections = self._normalise_sections(self.sections)
        self._intervals = self._normalise_intervals(self.check_interval)
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int):
            raise _bad("block_size", self.block_size, "use an int between 2 and 65536")
        if not 2 <= self.block_size <= 65536:
            raise _bad("block_size", self.block_size, "use an int between 2 and 65536")
        for name in ("threshold_scale", "near_inf"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise _bad(name, value, "use a positive finite number")
            if not (math.isfinite(value) and value > 0):
                raise _bad(name, value, "use a positive finite number")
        if self.events_file is not None and not isinstance(self.events_file, str):
            raise _bad("events_file", self.events_file, "use a path or None")
        if self.on_uncorrectable not in POLICIES:
            raise _bad(
                "on_uncorrectable", self.on_uncorrectable, f"choose from {', '.join(POLICIES)}"
            )
        self.on_uncorrectable = Policy(self.on_uncorrectable)

    @staticmethod
    def _normalise_sections(sections: str | Iterable[str]) -> tuple[str, ...]:
        if isinstance(sections, str):
            sections = [s.strip() for s in sections.split(",") if s.strip()]
        try:
            chosen = tuple(sections)
        except TypeError:
            raise _bad("sections", sections, f"use a subset of {', '.join(SECTIONS)}") from None
        for name in chosen:
            if name not in SECTIONS:
                raise ValueError(
                    f"ABFTConfig.sections: unknown section {name!r}; "
                    f"choose from {', '.join(SECTIONS)}"
                )
        if len(set(chosen)) != len(chosen):
            raise _bad("sections", sections, "name each section once")
        return tuple(s for s in SECTIONS if s in chosen)

    @staticmethod
    def _normalise_intervals(interval: int | Mapping[str, int]) -> dict[str, int]:
        def checked(name: str, value: object) -> int:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise _bad(name, value, "use an int >= 1 (1 = check every step)")
            return value

        if isinstance(interval, Mapping):
            for section in interval:
                if section not in SECTIONS:
                    raise ValueError(
                        f"ABFTConfig.check_interval: unknown section {section!r}; "
                        f"choose from {', '.join(SECTIONS)}"
                    )
            return {s: checked(f"check_interval[{s!r}]", interval.get(s, 1)) for s in SECTIONS}
        every = checked("check_interval", interval)
        return {s: every for s in SECTIONS}

    def interval(self, section: str) -> int:
        """The check interval of one section, in steps."""
        if section not in SECTIONS:
            raise ValueError(f"unknown section {section!r}; choose from {', '.join(SECTIONS)}")
        return self._intervals[section]

    def covers(self, section: str) -> bool:
        """Whether ``section`` is checked at all, on the steps its interval names."""
        return self.enabled and section in self.sections

    def on_interval(self, section: str, step: int) -> bool:
        """Whether training step ``step`` (counted from 0) is one of ``section``'s interval."""
        return step % self.interval(section) == 0

    def checks(self, section: str, step: int) -> bool:
        """Whether ``section`` is checked on training step ``step`` (counted from 0)."""
        return self.covers(section) and self.on_interval(section, step)
