"""Seeded fault injection into a tensor: the soft errors of docs/abft.md ("The faults it is
built for").

The last two dims of the tensor are a matrix, leading dims index a batch of matrices. A fault has
a kind (what the corrupted values become) and a pattern (which elements): one element (``0d``),
a whole row or column (``row``, ``col``, the 1D patterns; or a segment of one, with a block of
``(1, w)`` or ``(h, 1)``), or a block of at least 2x2 (``2d``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_abft.config import BACKWARD_SECTIONS

FAULT_KINDS: tuple[str, ...] = ("inf", "-inf", "nan", "near_inf", "bitflip", "value")
PATTERNS: tuple[str, ...] = ("0d", "row", "col", "2d")
NEAR_INF = 1e10
_INT_VIEW = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
}


@dataclass(frozen=True)
class TensorFault:
    """One fault to inject. Unset positions, signs and bits are drawn from ``seed``."""

    kind: str = "inf"
    """inf, -inf, nan, near_inf (|x| = 1e10, random sign), bitflip, or value."""
    pattern: str = "0d"
    """0d, row, col or 2d."""
    value: float | None = None
    """The finite value written by kind="value"."""
    bit: int | None = None
    """The bit flipped by kind="bitflip", 0 = least significant bit of the stored dtype."""
    position: tuple[int, int] | None = None
    """(row, col) of the element, or of the block's corner; the row or column for 1D patterns."""
    batch_index: int | None = None
    """Which matrix of the flattened batch."""
    block: tuple[int, int] | None = None
    """Rows and columns of a 2d block (default: drawn between 2 and 4), or of a row's or
    column's segment: ``(1, w)`` or ``(h, 1)`` (default: the whole row or column)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(
                f"TensorFault.kind: unknown kind {self.kind!r}; "
                f"choose from {', '.join(FAULT_KINDS)}"
            )
        if self.pattern not in PATTERNS:
            raise ValueError(
                f"TensorFault.pattern: unknown pattern {self.pattern!r}; "
                f"choose from {', '.join(PATTERNS)}"
            )
        if self.kind == "value" and (self.value is None or not math.isfinite(self.value)):
            raise ValueError(
                f"TensorFault.value: kind='value' needs a finite value, got {self.value!r}"
            )
        if self.bit is not None and not (isinstance(self.bit, int) and 0 <= self.bit < 32):
            raise ValueError(
                f"TensorFault.bit: {self.bit!r} is not a bit of a checked value; use 0..31 "
                "(0..15 in bf16 and fp16)"
            )
        if self.block is not None:
            shapes = {
                "2d": ("at least 2x2", lambda h, w: min(h, w) >= 2),
                "row": ("(1, w), w >= 1", lambda h, w: h == 1 and w >= 1),
                "col": ("(h, 1), h >= 1", lambda h, w: w == 1 and h >= 1),
                "0d": ("none", lambda h, w: False),
            }
            wanted, fits = shapes[self.pattern]
            if len(self.block) != 2 or not fits(*self.block):
                raise ValueError(
                    f"TensorFault.block: a {self.pattern} fault's block is {wanted}, "
                    f"got {self.block!r}"
                )


@dataclass(frozen=True)
class Injection:
    """Where a fault landed: the matrix (flattened batch index) and the corrupted rows and cols."""

    batch_index: int
    rows: tuple[int, int]
    """Half-open range [start, stop) of corrupted rows."""
    cols: tuple[int, int]


def _draw(generator: torch.Generator, high: int) -> int:
    return int(torch.randint(high, (1,), generator=generator))


def fill_value(fault: TensorFault, generator: torch.Generator) -> float:
    """The value a fault of any kind but bitflip writes (a near-INF sign drawn)."""
    if fault.kind == "near_inf":
        return NEAR_INF if _draw(generator, 2) else -NEAR_INF
    return {"inf": math.inf, "-inf": -math.inf, "nan": math.nan, "value": fault.value}[fault.kind]


def flip_mask(fault: TensorFault, generator: torch.Generator, bits: int) -> int:
    """The bit a bitflip flips in a ``bits``-wide value (drawn if unset), as the mask a signed
    integer of that width XORs with."""
    bit = fault.bit if fault.bit is not None else _draw(generator, bits)
    if not 0 <= bit < bits:
        raise ValueError(f"TensorFault.bit: a {bits}-bit value has bits 0..{bits - 1}, got {bit}")
    mask = 1 << bit
    if mask >= 1 << (bits - 1):  # the sign bit, as the signed integer of the same width
        mask -= 1 << bits
    return mask


def _corrupt(values: Tensor, fault: TensorFault, generator: torch.Generator) -> Tensor:
    if fault.kind != "bitflip":
        # stored as the hardware would: a value beyond the dtype's range becomes INF
        value = fill_value(fault, generator)
        return torch.full(values.shape, value, dtype=torch.float64).to(values.dtype)
    mask = flip_mask(fault, generator, torch.finfo(values.dtype).bits)
    return (values.contiguous().view(_INT_VIEW[values.dtype]) ^ mask).view(values.dtype)


def locate(fault: TensorFault, batch: int, m: int, n: int) -> tuple[Injection, torch.Generator]:
    """Where ``fault`` lands in a batch of ``batch`` matrices of ``m x n``, and the generator
    that drew it, for the draws that follow (a near-INF sign, a bit)."""
    if batch < 1 or m < 1 or n < 1:
        raise ValueError("a fault needs a non-empty matrix")
    generator = torch.Generator().manual_seed(fault.seed)
    b = fault.batch_index if fault.batch_index is not None else _draw(generator, batch)
    if not 0 <= b < batch:
        raise ValueError(f"TensorFault.batch_index {b} is out of range for {batch} matrices")
    if fault.pattern == "2d":
        if m < 2 or n < 2:
            raise ValueError(f"a 2d fault needs a matrix of at least 2x2, got {m}x{n}")
        h, w = fault.block or (
            2 + _draw(generator, min(3, m - 1)),
            2 + _draw(generator, min(3, n - 1)),
        )
        if h > m or w > n:
            raise ValueError(f"2d block {h}x{w} does not fit a {m}x{n} matrix")
        r, c = fault.position or (_draw(generator, m - h + 1), _draw(generator, n - w + 1))
        rows, cols = (r, r + h), (c, c + w)
    elif fault.block is not None:  # a row's or a column's segment
        h, w = fault.block
        if h > m or w > n:
            raise ValueError(f"a {h}x{w} segment does not fit a {m}x{n} matrix")
        r, c = fault.position or (_draw(generator, m - h + 1), _draw(generator, n - w + 1))
        rows, cols = (r, r + h), (c, c + w)
    else:
        r, c = fault.position or (_draw(generator, m), _draw(generator, n))
        rows = (0, m) if fault.pattern == "col" else (r, r + 1)
        cols = (0, n) if fault.pattern == "row" else (c, c + 1)
    if not (0 <= rows[0] < rows[1] <= m and 0 <= cols[0] < cols[1] <= n):
        raise ValueError(f"fault position {fault.position} is outside a {m}x{n} matrix")
    return Injection(batch_index=b, rows=rows, cols=cols), generator


@torch.no_grad()
def inject_(t: Tensor, fault: TensorFault) -> Injection:
    """Corrupt ``t [..., m, n]`` in place as ``fault`` says and report where."""
    if not isinstance(t, Tensor) or t.dtype not in _INT_VIEW:
        raise TypeError(
            f"inject_ needs a floating-point tensor, got {getattr(t, 'dtype', type(t))}"
        )
    if t.dim() < 2:
        raise ValueError(
            f"inject_ needs a tensor with at least 2 dims [..., m, n]; got {tuple(t.shape)}"
        )
    m, n = t.shape[-2:]
    batch = t.numel() // (m * n) if m * n else 0
    if batch == 0:
        raise ValueError("inject_ needs a non-empty tensor")
    where, generator = locate(fault, batch, m, n)
    index = [int(i) for i in torch.unravel_index(torch.tensor(where.batch_index), t.shape[:-2])]
    region = t[(*index, slice(*where.rows), slice(*where.cols))]  # a view, whatever the strides
    region.copy_(_corrupt(region, fault, generator))
    return where


# --- model-level injection --------------------------------------------------------------------

MODEL_SECTIONS: tuple[str, ...] = (
    "qkv",
    "q",
    "k",
    "v",
    "scores",
    "probs",
    "context",
    "proj",
) + BACKWARD_SECTIONS
"""Where a model-level fault can land: the checked GEMM outputs, the query, key or value part of
the QKV output, the softmax output ``probs`` (unfused attention only, and outside the guarantee:
its checksums are taken from the faulty P), and the flash attention's backward GEMMs."""

GUARD_OF = {
    "qkv": "qkv",
    "q": "qkv",
    "k": "qkv",
    "v": "qkv",
    "scores": "scores",
    "probs": "context",
    "context": "context",
    "proj": "proj",
    **{section: section for section in BACKWARD_SECTIONS},
}
"""The guard (checked section) a fault section lands in."""


@dataclass(frozen=True)
class Fault:
    """A fault for ``inject``: where in the model, when, and what (the tensor-level fields)."""

    section: str
    """One of MODEL_SECTIONS."""
    kind: str = "inf"
    pattern: str = "0d"
    layer: int | None = None
    """Megatron's 1-based layer number; None = every protected layer."""
    tp_rank: int | None = None
    """Tensor-parallel rank it lands on; None = every rank."""
    step: int | None = None
    """Training step (megatron_abft.set_step); None = the first forward under ``inject``."""
    value: float | None = None
    bit: int | None = None
    position: tuple[int, int] | None = None
    batch_index: int | None = None
    block: tuple[int, int] | None = None
    seed: int = 0
    persistent: bool = False
    """Every computation, recomputations included (the flash attention's kernels); False: the
    first only. The unfused layers land a fault once."""

    def __post_init__(self) -> None:
        if self.section not in MODEL_SECTIONS:
            raise ValueError(
                f"Fault.section: unknown section {self.section!r}; "
                f"choose from {', '.join(MODEL_SECTIONS)}"
            )
        for name in ("layer", "tp_rank", "step"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"Fault.{name}: {value!r} is not allowed; use an int >= 0 or None")
        self.tensor_fault()  # validates kind, pattern, value and block

    def tensor_fault(self) -> TensorFault:
        return TensorFault(
            self.kind,
            self.pattern,
            value=self.value,
            bit=self.bit,
            position=self.position,
            batch_index=self.batch_index,
            block=self.block,
            seed=self.seed,
        )


@dataclass
class ArmedFault:
    """A fault waiting in one guard, and the log its landing is written to."""

    fault: Fault
    log: list

    @property
    def section(self) -> str:
        return self.fault.section


def land(armed: ArmedFault, guard, output: Tensor, views: dict) -> bool:
    """Land ``armed`` in ``output`` if it is due in this forward; True once it is used up.
    ``views`` maps the sections this forward can corrupt to matrix views of ``output``."""
    fault = armed.fault
    if fault.step is not None and fault.step != guard.step:
        return False
    if fault.section not in views:
        return False  # it lands in the other forward of this guard (probs vs context)
    landed(armed, guard, inject_(views[fault.section](output), fault.tensor_fault()))
    return True


def landed(armed: ArmedFault, guard, where: Injection) -> None:
    """Log where ``armed`` landed in ``guard``'s layer."""
    fault = armed.fault
    armed.log.append(
        {
            **guard.where(),
            "section": fault.section,
            "kind": fault.kind,
            "pattern": fault.pattern,
            "injection": where,
        }
    )


def arm(guards: list, faults: list[Fault], log: list[dict]) -> list:
    """Arm ``faults`` in the ``guards`` they name, each landing logged to ``log``; returns the
    guards armed. Raises ValueError for a fault no guard of these can take."""
    layers = {g.layer for g in guards}
    armed_in = []
    for fault in faults:
        if not isinstance(fault, Fault):
            raise TypeError(f"inject takes Fault objects, got {type(fault).__name__}")
        if fault.layer is not None and fault.layer not in layers:
            raise ValueError(
                f"Fault.layer {fault.layer} is not a protected layer of this model; "
                f"layers: {sorted(x for x in layers if x is not None)}"
            )
        if not any(g.section == GUARD_OF[fault.section] for g in guards):
            backward = fault.section in BACKWARD_SECTIONS
            raise ValueError(
                f"no protected layer of this model checks section {fault.section!r}"
                + (" (the flash attention's backward)" if backward else "")
            )
        for guard in guards:
            if not (
                guard.section == GUARD_OF[fault.section]
                and fault.layer in (None, guard.layer)
                and fault.tp_rank in (None, guard.tp_rank)
            ):
                continue
            if guard.in_kernel and fault.section not in guard.fault_sections:
                raise ValueError(
                    f"section {fault.section!r} does not exist in the flash attention (layer "
                    f"{guard.layer}): P never leaves its kernels"
                )
            if fault.persistent and not guard.in_kernel:
                raise ValueError(
                    f"a persistent fault lands in the flash attention's kernels; layer "
                    f"{guard.layer}'s section {fault.section!r} lands a fault once"
                )
            if fault.section not in guard.fault_sections:  # e.g. no key columns on this rank
                if fault.tp_rank is not None:
                    raise ValueError(
                        f"section {fault.section!r} has no columns on tensor-parallel rank "
                        f"{guard.tp_rank} in layer {guard.layer} (fewer KV groups than ranks)"
                    )
                continue
            guard.faults.append(ArmedFault(fault, log))
            armed_in.append(guard)
    return armed_in


def disarm(guards: list, log: list[dict]) -> None:
    """Take the faults armed with ``log`` out of ``guards``, landed or not."""
    for guard in guards:
        guard.faults = [a for a in guard.faults if a.log is not log]
