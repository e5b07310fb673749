"""Locate and rebuild the bad elements of the flagged vectors of one side of a check, in place
(megatron_abft.check.eec, steps 1 and 2), remembering every write so that an uncorrectable matrix
can be put back exactly as the GEMM produced it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_abft.check.checksum import as_blocks, block_weights
from megatron_abft.check.sides import Check, Side
from megatron_abft.check.tolerance import thresholds


def crossing_flags(other: Side, side: Side) -> tuple[Tensor, Tensor]:
    """For each vector of ``side``: how many flagged vectors of ``other`` cross it inside its
    block, and the position of the first, or where none is, of the most suspect (largest
    |d1| / tau). Both ``[*batch, nb, N]``."""
    flags = as_blocks(other.flagged.mT.to(torch.uint8), side.ref.block, torch.uint8)
    count = flags.sum(-2, dtype=torch.int32)  # [*batch, nb, nb_other]
    ratio = (other.d1.abs() / other.tau).nan_to_num(0, 0, 0)
    score = as_blocks(torch.where(other.flagged, torch.inf, ratio).mT, side.ref.block, ratio.dtype)
    other_block = torch.arange(side.d1.shape[-1], device=flags.device) // other.ref.block
    return count[..., other_block], score.argmax(-2)[..., other_block]


@dataclass
class Correction:
    """Elements one side wrote: their index in its view, the values before, where a value was
    written (``done``) and a bound on the error of each written value (0 for recomputed ones)."""

    view: Tensor
    index: tuple[Tensor, ...]
    before: Tensor
    done: Tensor
    error_bound: Tensor

    @classmethod
    def write(
        cls, view: Tensor, index: tuple[Tensor, ...], value: Tensor, ok: Tensor, error_bound: Tensor
    ) -> Correction:
        """Write ``value`` where ``ok``, in place, and remember what was there."""
        before = view[index]
        view.index_put_(index, torch.where(ok, value.to(before.dtype), before))
        done = ok.expand(before.shape)
        return cls(view, index, before, done, torch.where(done, error_bound, 0))

    def undo_where(self, unresolved: Tensor) -> None:
        undo = unresolved[self.index[:-2]]
        self.view.index_put_(self.index, torch.where(undo, self.before, self.view[self.index]))


def vectors_to_correct(side: Side, touched: Tensor | None, again: bool) -> Tensor:
    """The vectors of a side to correct: the flagged ones (unless the side goes ``again``), and
    those ``touched`` by the other side's corrections."""
    return side.flagged if touched is None else touched if again else side.flagged | touched


def correct_side(
    side: Side,
    crossing: tuple[Tensor, Tensor] | None,
    check: Check,
    touched: Tensor | None = None,
    again: bool = False,
) -> list[Correction]:
    """Correct up to ``check.capacity`` vectors of one side in place (vectors_to_correct) that
    no longer check clean. Without the operands the located bad element is rebuilt from the
    checksum; with them, see _recompute."""
    batch_shape = side.view.shape[:-2]
    nb, n = side.d1.shape[-2:]
    flat = vectors_to_correct(side, touched, again).reshape(-1)
    picked = torch.topk(
        flat.to(torch.uint8), min(check.capacity, flat.numel()), sorted=False
    ).indices
    batch_flat, blk, j = torch.unravel_index(picked, (flat.numel() // (nb * n), nb, n))
    batch = torch.unravel_index(batch_flat, tuple(batch_shape))

    def take(t: Tensor) -> Tensor:
        return t.expand(*batch_shape, nb, n).reshape(-1)[picked]

    vec = side.vectors(batch, blk, j)  # [K, block]
    d1, d2, tau, tau_w = take(side.d1), take(side.d2), take(side.tau), take(side.tau_w)
    length = torch.clamp(side.ref.length - blk * side.ref.block, max=side.ref.block)

    # the weighted location, where the noise bound keeps d2/d1 within half a position
    finite = torch.isfinite(d1) & torch.isfinite(d2)
    loc_w = torch.round(d2 / d1).nan_to_num(0, 0, 0).clamp(-1, side.ref.block).long() - 1
    in_block = finite & (loc_w >= 0) & (loc_w < length)
    ok_w = in_block & (d1.abs() > 2 * (tau_w + length * tau))
    # the single extreme element, where the differences overflowed or are NaN
    extreme = ~torch.isfinite(vec) | (vec.abs() > check.near_inf)
    loc_x = torch.where(torch.isnan(vec), torch.inf, vec.abs()).argmax(-1)
    ok_x = ~finite & (extreme.sum(-1) == 1)
    loc, ok = torch.where(ok_w, loc_w, loc_x), ok_w | ok_x
    if crossing is not None:  # exactly one flagged crossing vector pins the element down
        count, suspect = take(crossing[0]), take(crossing[1])
        loc = torch.where(count == 1, suspect, loc)
        ok = torch.where(count == 1, True, ok & (count == 0))
    flagged = take(side.flagged)
    ok &= flagged

    bias = side.ref.bias_magnitude
    picks = _Picked(
        side,
        batch,
        blk,
        j,
        flagged,
        vec,
        length,
        take(side.ref.sums[..., 0, :]),
        take(side.ref.sums[..., 1, :]),
        take(side.ref.magnitude),
        None if bias is None else take(bias),
    )
    if check.operands is None:
        value, bound, _ = picks.put(check, loc)
        ok &= torch.isfinite(value) & torch.isfinite(bound)
        return [Correction.write(side.view, picks.at(loc), value, ok, bound)]

    fix = torch.zeros_like(flagged) if again else flagged
    if touched is not None:  # the other side's writes may have exposed errors there
        current = vec.gather(-1, picks.clamp(loc).unsqueeze(-1)).squeeze(-1)
        fix = fix | take(touched) & ~picks.put(check, loc, current)[2]
    # not located: the weighted location however noisy, else the extreme element; then the most
    # suspect crossing vector
    candidates = [torch.where(ok, loc, torch.where(in_block, loc_w, loc_x))]
    several = torch.zeros_like(fix)
    if crossing is not None:
        candidates.append(suspect)
        several = flagged & (count >= 2)  # and maybe more below the threshold
    return _recompute(picks, check, fix, several, candidates)


@dataclass(frozen=True)
class _Picked:
    """The vectors of one side picked for correction: where they are, whether flagged, their
    block ``vec`` (``[K, block]``, zero past its ``length``) and its checksums and magnitudes."""

    side: Side
    batch: tuple[Tensor, ...]
    blk: Tensor
    j: Tensor
    flagged: Tensor
    vec: Tensor
    length: Tensor
    c0: Tensor
    c0_w: Tensor
    magnitude: Tensor
    bias_magnitude: Tensor | None

    def clamp(self, loc: Tensor) -> Tensor:
        return torch.minimum(loc.clamp(min=0), self.length - 1)

    def at(self, loc: Tensor) -> tuple[Tensor, ...]:
        """The index in the view of element ``loc`` of each block."""
        return (*self.batch, self.blk * self.side.ref.block + self.clamp(loc), self.j)

    def put(
        self, check: Check, loc: Tensor, x: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Each block with element ``loc`` set to ``x``, by default the checksum's rebuild
        c0 - sum_{i != loc} x_i: x, the block's threshold tau, and whether the block then checks
        clean, with half of tau and tau_w to spare (the re-verification sums in another order)."""
        loc = self.clamp(loc)
        others = self.vec.scatter(-1, loc.unsqueeze(-1), 0)
        x = self.c0 - others.sum(-1) if x is None else x
        w = block_weights(self.side.ref.block, others.device, others.dtype)[1]
        weight = (loc + 1).to(others.dtype)
        tau, tau_w = thresholds(
            check.rounding,
            size=others.abs().sum(-1) + x.abs(),
            size_w=others.abs() @ w + weight * x.abs(),
            magnitude=self.magnitude,
            bias_magnitude=self.bias_magnitude,
            length=self.side.length,
            inner=self.side.ref.inner,
            scale=check.scale,
        )
        clean = (
            torch.isfinite(x)
            & torch.isfinite(tau)
            & ((self.c0 - others.sum(-1) - x).abs() <= tau / 2)
            & ((self.c0_w - others @ w - weight * x).abs() <= tau_w / 2)
        )
        return x, tau, clean


def _recompute(
    picks: _Picked, check: Check, fix: Tensor, several: Tensor, candidates: list[Tensor]
) -> list[Correction]:
    """Recompute from the operands, for each vector to ``fix``, the first of the ``candidates``
    elements whose new value alone makes its vector check clean; or, for the others and those
    with ``several`` errors, the whole block."""
    view, corrections, left = picks.side.view, [], fix
    for loc in candidates:
        index = picks.at(loc)
        value = picks.side.recompute(check.operands, *index)
        stored = value.to(view.dtype).to(picks.vec.dtype)
        alone = left & ~several & picks.put(check, loc, stored)[2]
        corrections.append(Correction.write(view, index, value, alone, torch.zeros_like(value)))
        left = left & ~alone
    return [*corrections, _recompute_blocks(picks, check, left)]


def _recompute_blocks(picks: _Picked, check: Check, whole: Tensor) -> Correction:
    """Recompute from the operands the whole block of the vectors marked ``whole``, flagged ones
    first, in place: as many as ``check.capacity`` elements fill (the rest stay wrong, so they are
    uncorrectable)."""
    side = picks.side
    budget = min(whole.numel(), -(-check.capacity // side.length))
    priority = whole.to(torch.uint8) * (1 + picks.flagged.to(torch.uint8))
    chosen = torch.topk(priority, budget, sorted=False).indices
    # past the end of the view, each block repeats its last element, so that its writes agree
    offset = torch.arange(side.ref.block, device=whole.device).minimum(
        picks.length[chosen].unsqueeze(-1) - 1
    )  # [B, block]
    batch = tuple(i[chosen].unsqueeze(-1) for i in picks.batch)
    rows = picks.blk[chosen].unsqueeze(-1) * side.ref.block + offset
    index = (*batch, rows, picks.j[chosen].unsqueeze(-1))
    value = side.recompute(check.operands, *index).gather(-1, offset)
    ok = whole[chosen].unsqueeze(-1) & torch.isfinite(value).all(-1, keepdim=True)
    return Correction.write(side.view, index, value, ok, torch.zeros_like(value))


def sum_into(other: Side, corrections: list[Correction], values: list[Tensor]) -> Tensor:
    """Per vector of ``other``: the sum of ``values``, one per element the corrections wrote."""
    total = torch.zeros_like(other.d1)
    for correction, value in zip(corrections, values, strict=True):
        *batch, rows, j = correction.index  # j indexes the writer's vectors, rows its checked dim
        where = (*batch, j // other.ref.block, rows)
        total.index_put_(where, value.to(total.dtype).expand(rows.shape), accumulate=True)
    return total
