"""One side of an EEC-ABFT check (megatron_abft.check.eec): the vectors of C that one set of
reference checksums covers (C's columns, or C's rows as the columns of C^T), the sums recomputed
from C, their differences from the references, the rounding thresholds and the flags.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from megatron_abft.check.checksum import Checksums, GemmOperands, as_blocks, block_weights
from megatron_abft.check.tolerance import Rounding, threshold_terms, thresholds
from megatron_abft.ops import compiled


@dataclass(frozen=True)
class Check:
    """The settings of one verify_and_correct call."""

    rounding: Rounding
    scale: float
    near_inf: float
    capacity: int
    operands: GemmOperands | None


class KernelSides(NamedTuple):
    """Both sides of a check as the kernels take them, the arguments of ``screen`` after C: per
    side its block (0: the side is not checked), its references ``[sums, magnitude(,
    bias_magnitude)]`` and its bounds (the threshold terms, then a block's length)."""

    col_block: int
    row_block: int
    col: list[Tensor]
    row: list[Tensor]
    col_bounds: list[float]
    row_bounds: list[float]


NO_SCREEN = KernelSides(0, 0, [], [], [], [])
"""The sides of a screen that screens nothing (a Reader's read of an output not due)."""


@dataclass
class Side:
    """One side of a check: its vectors, their reference checksums, the differences ``d1``
    (plain) and ``d2`` (weighted) from the sums recomputed from C, their thresholds and flags."""

    view: Tensor  # [*batch, R, N]: the vectors are its N columns (C, or C^T for the rows)
    ref: Checksums
    transposed: bool
    d1: Tensor  # [*batch, nb, N]
    d2: Tensor
    tau: Tensor
    tau_w: Tensor
    flagged: Tensor

    @property
    def length(self) -> int:
        return min(self.ref.block, self.ref.length)

    def vectors(self, batch: tuple[Tensor, ...], blk: Tensor, j: Tensor) -> Tensor:
        """The blocks of the vectors (batch, blk, j) as ``[K, block]`` in the checksums' dtype,
        zero past the end of the view (gathered from C, which is never copied whole)."""
        block, length = self.ref.block, self.view.shape[-2]
        rows = blk.unsqueeze(-1) * block + torch.arange(block, device=blk.device)
        index = (*(i.unsqueeze(-1) for i in batch), rows.clamp(max=length - 1), j.unsqueeze(-1))
        return torch.where(rows < length, self.view[index].to(self.ref.sums.dtype), 0)

    def recompute(self, operands: GemmOperands, *index: Tensor) -> Tensor:
        """The elements (*batch, rows, j) of the view recomputed from the GEMM's operands."""
        *batch, rows, j = index
        c_rows, c_cols = (j, rows) if self.transposed else (rows, j)
        return operands.elements(tuple(batch), self.view.shape[:-2], c_rows, c_cols)


def inspect_sides(
    c: Tensor, refs: dict[str, Checksums], check: Check, slack: dict[str, Tensor] | None = None
) -> dict[str, Side]:
    """Recompute the sums of every vector of each side (``"col"``, ``"row"``) and compare them
    with the references. ``slack`` widens a side's thresholds by the error of values rebuilt from
    the other side."""
    slack = slack or {}
    found = _block_sums(c, refs)
    return {
        name: _compare(c, ref, name == "row", check, *found[name], slack.get(name))
        for name, ref in refs.items()
    }


def screen(c: Tensor, refs: dict[str, Checksums], check: Check) -> Tensor | None:
    """Per matrix of ``c``, how many vectors the compiled kernels flag in one op (block sums,
    differences and thresholds of both sides), or None where they do not apply. The kernels'
    thresholds are a hair tighter than inspect_sides' (csrc/kernels/abft.h, kScreenMargin), so a
    matrix they pass has no vector that inspect_sides would flag."""
    sides = kernel_sides(c, refs, check)
    return None if sides is None else compiled.screen(c, *sides)


def kernel_sides(c: Tensor, refs: dict[str, Checksums], check: Check) -> KernelSides | None:
    """Both sides of a check as the kernels take them; None where a reference is not in c's
    accumulation dtype."""
    natural = torch.float64 if c.dtype == torch.float64 else torch.float32
    sides, blocks, bounds = {}, {}, {}
    for name in ("col", "row"):
        ref = refs.get(name)
        sides[name], blocks[name], bounds[name] = [], 0, []
        if ref is None:
            continue
        tensors = [ref.sums, ref.magnitude]
        if ref.bias_magnitude is not None:
            tensors.append(ref.bias_magnitude)
        if any(t.dtype != natural for t in tensors):
            return None
        bounds[name] = side_bounds(check, ref.block, ref.length, ref.inner)
        sides[name], blocks[name] = tensors, ref.block
    return KernelSides(
        blocks["col"], blocks["row"], sides["col"], sides["row"], bounds["col"], bounds["row"]
    )


def side_bounds(check: Check, block: int, length: int, inner: int) -> list[float]:
    """One side's bounds as the kernels take them, for vectors of ``length`` summed in blocks of
    ``block`` from a GEMM with inner dimension ``inner``: the threshold terms, then the length
    of a block."""
    length = min(block, length)
    terms = threshold_terms(check.rounding, length=length, inner=inner, scale=check.scale)
    return [*terms, float(length)]


def _block_sums(c: Tensor, refs: dict[str, Checksums]) -> dict[str, tuple[Tensor, Tensor]]:
    """Per side, the plain and weighted sums of C's vectors and of their magnitudes, each
    ``[*batch, nb, 2, N]`` in the checksums' dtype. The compiled kernels read C once for both
    sides; the PyTorch path (the reference) reads it once per side. Row sums run along C's own
    last dim, so C is never transposed in memory."""
    natural = torch.float64 if c.dtype == torch.float64 else torch.float32
    if all(ref.sums.dtype == natural for ref in refs.values()):
        col, row = (refs[name].block if name in refs else 0 for name in ("col", "row"))
        fused = compiled.block_sums(c, col, row)
        if fused is not None:
            return {name: fused[:2] if name == "col" else fused[2:] for name in refs}
    found = {}
    for name, ref in refs.items():
        dtype = ref.sums.dtype
        weights = block_weights(ref.block, c.device, dtype)
        if name == "row":
            blocks = as_blocks(c, ref.block, dtype, dim=-1)  # [*batch, m, nb, block]
            found[name] = (
                (blocks @ weights.T).movedim(-3, -1),
                (blocks.abs() @ weights.T).movedim(-3, -1),
            )
        else:
            blocks = as_blocks(c, ref.block, dtype)  # [*batch, nb, block, n]
            found[name] = (weights @ blocks, weights @ blocks.abs())
    return found


def _compare(
    c: Tensor,
    ref: Checksums,
    transposed: bool,
    check: Check,
    sums: Tensor,
    sizes: Tensor,
    slack: Tensor | None,
) -> Side:
    """One side's differences, thresholds and flags from its recomputed ``sums`` and ``sizes``."""
    d1, d2 = (ref.sums - sums).unbind(-2)  # plain and weighted differences
    size, size_w = sizes.unbind(-2)
    length = min(ref.block, ref.length)
    tau, tau_w = thresholds(
        check.rounding,
        size=size,
        size_w=size_w,
        magnitude=ref.magnitude,
        bias_magnitude=ref.bias_magnitude,
        length=length,
        inner=ref.inner,
        scale=check.scale,
    )
    if slack is not None:
        tau, tau_w = tau + slack, tau_w + length * slack
    clean = torch.isfinite(tau_w) & (d1.abs() <= tau) & (d2.abs() <= tau_w)
    view = c.mT if transposed else c
    return Side(view, ref, transposed, d1, d2, tau, tau_w, ~clean)
