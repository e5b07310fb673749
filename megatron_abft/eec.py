"""Verify, locate and correct one checked GEMM output in place (EEC-ABFT, DESIGN.md section 2).

``verify_and_correct(c, col, row)`` compares the reference checksums of C (from the inputs, see
megatron_abft.checksum) with sums recomputed from C (both sides in one read of C by the compiled
kernels of megatron_abft._ext where they are built), then for every flagged vector:

1. locates the bad element: from the other side's flags when exactly one crossing vector is
   flagged (exact for any 0D error), else from the weighted checksum, loc = round(d2/d1) - 1, when
   the rounding bound makes that unambiguous, else as the single extreme element (NaN, INF or
   |x| > near_inf) when the differences themselves are not finite;
2. rebuilds it: x[loc] = c0 - sum_{i != loc} x_i from the checksum, or, when the GEMM's operands
   are given, recomputes it from them (as exact as the GEMM). With the operands, a recomputed
   element is kept only if its vector then checks clean; a vector not located tries the weighted
   location however noisy, then the most suspect crossing vector; and a vector that no single
   element makes clean, or that several flagged vectors cross (several errors, more perhaps too
   small to flag), has its whole block recomputed. The vectors one side wrote into are then
   revisited on the other side (columns, rows, then the columns the rows wrote into): a partial
   correction can expose errors that cancelled below their threshold;
3. re-verifies both sides: a matrix with any vector still inconsistent is uncorrectable, and is
   put back exactly as the GEMM produced it.

Results are device tensors. By default nothing is read on the host on CUDA (``sync_free``), so
the correction path runs on every call there; on CPU it is skipped when nothing was flagged,
which costs no sync there, and ``sync_free=False`` does the same on any device for one sync.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from megatron_abft import _ext
from megatron_abft.checksum import (
    FLOATING,
    Checksums,
    as_blocks,
    block_weights,
    broadcast_shapes,
    nblocks,
)
from megatron_abft.tolerance import Rounding, gemm_rounding, thresholds

KINDS: tuple[str, ...] = ("finite", "near_inf", "inf", "nan")
"""Kinds of fault, by the worst checksum difference a matrix showed."""

OUTCOMES: tuple[str, ...] = ("detected", "corrected", "uncorrectable")

CLEAN, CORRECTED, UNCORRECTABLE = 0, 1, 2


@dataclass(frozen=True)
class GemmOperands:
    """The inputs of ``C = alpha * a @ b + bias``, used to recompute located elements exactly."""

    a: Tensor
    b: Tensor
    alpha: float = 1.0
    bias: Tensor | None = None

    def elements(
        self, batch: tuple[Tensor, ...], batch_shape, rows: Tensor, cols: Tensor
    ) -> Tensor:
        """C[batch, rows, cols] recomputed in fp32 (fp64 for fp64 operands)."""
        a = self.a.detach().expand(*batch_shape, *self.a.shape[-2:])
        b = self.b.detach().expand(*batch_shape, *self.b.shape[-2:])
        dtype = torch.float64 if torch.float64 in (a.dtype, b.dtype) else torch.float32
        a_rows = a[(*batch, rows)].to(dtype)  # [K, k]
        b_cols = b[(*batch, slice(None), cols)].to(dtype)  # [K, k]
        value = self.alpha * (a_rows * b_cols).sum(-1)
        if self.bias is not None:
            value = value + self.bias.detach().to(dtype)[cols]
        return value


@dataclass(frozen=True)
class EECResult:
    """What one ``verify_and_correct`` call found, as device tensors.

    ``counts[o, k]`` counts matrices with outcome ``OUTCOMES[o]`` and kind ``KINDS[k]``;
    the rest is per matrix of the batch: ``status`` (CLEAN, CORRECTED or UNCORRECTABLE),
    ``kind``, the ``row`` and ``col`` of the most wrong flagged row and column (-1 where none is)
    and ``magnitude``, the largest checksum difference |d1| seen (the size of the error).
    """

    counts: Tensor
    status: Tensor
    kind: Tensor
    row: Tensor
    col: Tensor
    magnitude: Tensor


def report(result: EECResult) -> dict[str, dict[str, int]]:
    """The counters as plain Python numbers (one host synchronisation)."""
    counts = result.counts.tolist()
    return {o: dict(zip(KINDS, counts[i], strict=True)) for i, o in enumerate(OUTCOMES)}


@dataclass(frozen=True)
class Residuals:
    """Per checked vector ``[..., nblocks, n]``: the differences between reference and recomputed
    sums (plain ``d1``, weighted ``d2``), their thresholds and whether the vector is flagged."""

    d1: Tensor
    d2: Tensor
    tau: Tensor
    tau_w: Tensor
    flagged: Tensor


@torch.no_grad()
def residuals(
    c: Tensor, ref: Checksums, *, side: str = "col", threshold_scale: float = 1.0
) -> Residuals:
    """Compare one side of ``c`` (``"col"`` or ``"row"``) with its reference checksums, without
    correcting anything."""
    if side not in ("col", "row"):
        raise ValueError(f"side must be 'col' or 'row', got {side!r}")
    _check_inputs(c, ref if side == "col" else None, ref if side == "row" else None)
    check = _Check(gemm_rounding(c.dtype, c.device), threshold_scale, 0.0, 0, None)
    found = _inspect(c, {side: ref}, check)[side]
    return Residuals(found.d1, found.d2, found.tau, found.tau_w, found.flagged)


@torch.no_grad()
def verify_and_correct(
    c: Tensor,
    col: Checksums | None = None,
    row: Checksums | None = None,
    *,
    operands: GemmOperands | None = None,
    threshold_scale: float = 1.0,
    near_inf: float = 1e10,
    max_corrections: int | None = None,
    check_references: bool = True,
    sync_free: bool = True,
) -> EECResult:
    """Check ``c [..., m, n]`` against its column and/or row checksums and correct it in place.

    ``operands`` (the GEMM's inputs) make corrections as exact as the GEMM; without them the bad
    element is rebuilt from the checksum. At most ``max_corrections`` (default max(m, n)) vectors
    per side are corrected in one call, enough for one 1D fault; the rest are uncorrectable. Whole
    blocks recomputed from the operands are limited to as many elements per side and pass.
    ``check_references`` rejects non-finite reference checksums with a ValueError, at the cost of
    one host synchronisation; the protected layers turn it off and count such matrices as
    uncorrectable instead. ``sync_free=False`` lets a device other than the CPU read whether
    anything was flagged (one host synchronisation) and skip the correction path when nothing was,
    as the CPU always does.
    """
    _check_inputs(c, col, row)
    if operands is not None:
        _check_operands_fit(c, operands)
    if check_references:
        _check_references_finite(col, row)
    if c.numel() == 0:  # an empty output: nothing to check
        return _clean_result(c)
    if c.dim() == 2:  # one matrix: give it a batch dim so that indexing is uniform
        result = verify_and_correct(
            c.unsqueeze(0),
            _batched(col),
            _batched(row),
            operands=operands,
            threshold_scale=threshold_scale,
            near_inf=near_inf,
            max_corrections=max_corrections,
            check_references=False,
            sync_free=sync_free,
        )
        return EECResult(
            result.counts,
            *(t[0] for t in (result.status, result.kind, result.row, result.col, result.magnitude)),
        )

    capacity = max_corrections if max_corrections is not None else max(c.shape[-2:])
    check = _Check(gemm_rounding(c.dtype, c.device), threshold_scale, near_inf, capacity, operands)
    refs = {name: ref for name, ref in (("col", col), ("row", row)) if ref is not None}
    sides = _inspect(c, refs, check)
    if (c.device.type == "cpu" or not sync_free) and not any(
        bool(s.flagged.any()) for s in sides.values()
    ):
        return _clean_result(c)
    detected = _any_flagged(sides.values(), c.shape[:-2])
    kind = torch.stack([_kind(s, near_inf).amax((-2, -1)) for s in sides.values()]).amax(0)
    row, col, magnitude = _where(sides, c.shape[:-2])

    corrections, slack, touched = [], {}, {}
    # with the operands the column side goes again, for the columns the row side wrote into
    order = ["col", "row", "col"] if operands is not None and len(sides) == 2 else list(sides)
    for i, name in enumerate(order):
        side, other_name = sides[name], "row" if name == "col" else "col"
        again = name in order[:i]
        if c.device.type == "cpu" and not bool(_wanted(side, touched.get(name), again).any()):
            continue  # nothing to correct on this side, which costs no sync to know on CPU
        other = sides.get(other_name)
        crossing = _crossing(other, side) if other else None
        written = _correct_side(side, crossing, check, touched.get(name), again)
        corrections += written
        if other and operands is None:  # rebuilt values carry this side's rounding noise
            slack[other_name] = _into(other, written, [w.error_bound for w in written])
        elif other:
            touched[other_name] = _into(other, written, [w.done for w in written]) > 0
        if c.device.type == "cpu" and i + 1 < len(order):  # stop once C checks clean
            rechecked = _inspect(c, refs, check, slack).values()
            if not any(bool(s.flagged.any()) for s in rechecked):
                break
    else:
        rechecked = _inspect(c, refs, check, slack).values()
    unresolved = _any_flagged(rechecked, c.shape[:-2])
    for correction in reversed(corrections):  # an uncorrectable matrix is left as it was
        correction.undo_where(unresolved)

    status = torch.where(unresolved, UNCORRECTABLE, torch.where(detected, CORRECTED, CLEAN))
    outcome = torch.stack([detected, detected & ~unresolved, unresolved]).reshape(3, -1)
    one_hot = torch.nn.functional.one_hot(kind.reshape(-1).long(), len(KINDS))
    counts = (outcome.unsqueeze(-1).long() * one_hot).sum(1)
    return EECResult(
        counts=counts,
        status=status.to(torch.int8),
        kind=kind.to(torch.int8),
        row=row,
        col=col,
        magnitude=magnitude,
    )


def _clean_result(c: Tensor) -> EECResult:
    """The result of a check of ``c`` that found nothing."""
    batch = c.shape[:-2]
    none = torch.full(batch, -1, dtype=torch.long, device=c.device)
    zeros = torch.zeros(batch, dtype=torch.int8, device=c.device)
    counts = torch.zeros(len(OUTCOMES), len(KINDS), dtype=torch.long, device=c.device)
    return EECResult(
        counts, zeros, zeros.clone(), none, none.clone(), torch.zeros(batch, device=c.device)
    )


# --- one side of a check: the vectors are the columns of a view (C or C^T), in blocks ---------


@dataclass(frozen=True)
class _Check:
    """The settings of one verify_and_correct call."""

    rounding: Rounding
    scale: float
    near_inf: float
    capacity: int
    operands: GemmOperands | None


@dataclass
class _Side:
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


def _inspect(
    c: Tensor, refs: dict[str, Checksums], check: _Check, slack: dict[str, Tensor] | None = None
) -> dict[str, _Side]:
    """Recompute the sums of every vector of each side (``"col"``, ``"row"``) and compare them
    with the references. ``slack`` widens a side's thresholds by the error of values rebuilt from
    the other side."""
    slack = slack or {}
    found = _block_sums(c, refs)
    return {
        name: _compare(c, ref, name == "row", check, *found[name], slack.get(name))
        for name, ref in refs.items()
    }


def _block_sums(c: Tensor, refs: dict[str, Checksums]) -> dict[str, tuple[Tensor, Tensor]]:
    """Per side, the plain and weighted sums of C's vectors and of their magnitudes, each
    ``[*batch, nb, 2, N]`` in the checksums' dtype. The compiled kernels read C once for both
    sides; the PyTorch path (the reference) reads it once per side. Row sums run along C's own
    last dim, so C is never transposed in memory."""
    natural = torch.float64 if c.dtype == torch.float64 else torch.float32
    if all(ref.sums.dtype == natural for ref in refs.values()):
        col, row = (refs[name].block if name in refs else 0 for name in ("col", "row"))
        fused = _ext.block_sums(c, col, row)
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
    check: _Check,
    sums: Tensor,
    sizes: Tensor,
    slack: Tensor | None,
) -> _Side:
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
    return _Side(view, ref, transposed, d1, d2, tau, tau_w, ~clean)


def _kind(side: _Side, near_inf: float) -> Tensor:
    """Per vector: index into KINDS of its checksum difference (0 where not flagged). A difference
    of at least near_inf / 2 is near-INF: an injected |x| = near_inf minus the true value."""
    d1 = side.d1
    kind = torch.where(d1.abs() >= near_inf / 2, 1, 0)
    kind = torch.where(torch.isinf(d1), 2, kind)
    kind = torch.where(torch.isnan(d1) | torch.isnan(side.d2), 3, kind)
    return torch.where(side.flagged, kind, 0)


def _where(sides: dict[str, _Side], batch_shape) -> tuple[Tensor, Tensor, Tensor]:
    """Per matrix: the most wrong flagged row (from the row side) and column (from the column
    side), -1 where that side flagged nothing or is not checked, and the largest |d1|."""
    index, magnitude = {}, []
    for name, side in sides.items():
        error = torch.where(side.flagged, side.d1.abs().nan_to_num(torch.inf), -1.0)
        worst, flat = error.flatten(-2).max(-1)  # over blocks and vectors
        vector = flat % side.d1.shape[-1]
        index[name] = torch.where(worst >= 0, vector, -1).expand(batch_shape)
        magnitude.append(
            torch.where(side.flagged, side.d1.abs(), 0).flatten(-2).amax(-1).expand(batch_shape)
        )
    missing = torch.full(batch_shape, -1, dtype=torch.long, device=magnitude[0].device)
    return index.get("row", missing), index.get("col", missing), torch.stack(magnitude).amax(0)


def _any_flagged(sides, batch_shape) -> Tensor:
    flags = [s.flagged.flatten(-2).any(-1).expand(batch_shape) for s in sides]
    return torch.stack(flags).any(0)


def _crossing(other: _Side, side: _Side) -> tuple[Tensor, Tensor]:
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
class _Correction:
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
    ) -> _Correction:
        """Write ``value`` where ``ok``, in place, and remember what was there."""
        before = view[index]
        view.index_put_(index, torch.where(ok, value.to(before.dtype), before))
        done = ok.expand(before.shape)
        return cls(view, index, before, done, torch.where(done, error_bound, 0))

    def undo_where(self, unresolved: Tensor) -> None:
        undo = unresolved[self.index[:-2]]
        self.view.index_put_(self.index, torch.where(undo, self.before, self.view[self.index]))


def _wanted(side: _Side, touched: Tensor | None, again: bool) -> Tensor:
    """The vectors of a side to correct: the flagged ones (unless the side goes ``again``), and
    those ``touched`` by the other side's corrections."""
    return side.flagged if touched is None else touched if again else side.flagged | touched


def _correct_side(
    side: _Side,
    crossing: tuple[Tensor, Tensor] | None,
    check: _Check,
    touched: Tensor | None = None,
    again: bool = False,
) -> list[_Correction]:
    """Correct up to ``check.capacity`` vectors of one side in place (_wanted) that no longer
    check clean. Without the operands the located bad element is rebuilt from the checksum; with
    them, see _recompute."""
    batch_shape = side.view.shape[:-2]
    nb, n = side.d1.shape[-2:]
    flat = _wanted(side, touched, again).reshape(-1)
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
        return [_Correction.write(side.view, picks.at(loc), value, ok, bound)]

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

    side: _Side
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
        self, check: _Check, loc: Tensor, x: Tensor | None = None
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
    picks: _Picked, check: _Check, fix: Tensor, several: Tensor, candidates: list[Tensor]
) -> list[_Correction]:
    """Recompute from the operands, for each vector to ``fix``, the first of the ``candidates``
    elements whose new value alone makes its vector check clean; or, for the others and those
    with ``several`` errors, the whole block."""
    view, corrections, left = picks.side.view, [], fix
    for loc in candidates:
        index = picks.at(loc)
        value = picks.side.recompute(check.operands, *index)
        stored = value.to(view.dtype).to(picks.vec.dtype)
        alone = left & ~several & picks.put(check, loc, stored)[2]
        corrections.append(_Correction.write(view, index, value, alone, torch.zeros_like(value)))
        left = left & ~alone
    return [*corrections, _recompute_blocks(picks, check, left)]


def _recompute_blocks(picks: _Picked, check: _Check, whole: Tensor) -> _Correction:
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
    return _Correction.write(side.view, index, value, ok, torch.zeros_like(value))


def _into(other: _Side, corrections: list[_Correction], values: list[Tensor]) -> Tensor:
    """Per vector of ``other``: the sum of ``values``, one per element the corrections wrote."""
    total = torch.zeros_like(other.d1)
    for correction, value in zip(corrections, values, strict=True):
        *batch, rows, j = correction.index  # j indexes the writer's vectors, rows its checked dim
        where = (*batch, j // other.ref.block, rows)
        total.index_put_(where, value.to(total.dtype).expand(rows.shape), accumulate=True)
    return total


# --- input checks -----------------------------------------------------------------------------


def _batched(ref: Checksums | None) -> Checksums | None:
    if ref is None:
        return None
    bias = ref.bias_magnitude
    return replace(
        ref,
        sums=ref.sums.unsqueeze(0),
        magnitude=ref.magnitude.unsqueeze(0),
        bias_magnitude=None if bias is None else bias.unsqueeze(0),
    )


def _check_inputs(c: Tensor, col: Checksums | None, row: Checksums | None) -> None:
    if not isinstance(c, Tensor):
        raise TypeError(f"c must be a torch.Tensor, got {type(c).__name__}")
    if c.dtype not in FLOATING:
        raise TypeError(f"c must be fp64, fp32, bf16 or fp16; got {c.dtype}")
    if c.dim() < 2:
        raise ValueError(f"c must have at least 2 dims [..., m, n]; got {tuple(c.shape)}")
    if col is None and row is None:
        raise ValueError("give at least one side's checksums (col=..., row=...)")
    m, n = c.shape[-2:]
    for name, ref, checked, across in (("col", col, m, n), ("row", row, n, m)):
        if ref is None:
            continue
        if not isinstance(ref, Checksums):
            raise TypeError(f"{name} must be Checksums, got {type(ref).__name__}")
        if ref.sums.device != c.device:
            raise ValueError(f"{name} checksums are on {ref.sums.device} but c is on {c.device}")
        expected = (nblocks(checked, ref.block), 2, across)
        try:
            fits = broadcast_shapes(ref.sums.shape[:-3], c.shape[:-2]) == c.shape[:-2]
        except RuntimeError:
            fits = False
        if ref.length != checked or tuple(ref.sums.shape[-3:]) != expected or not fits:
            raise ValueError(
                f"{name} checksums of shape {tuple(ref.sums.shape)} (length {ref.length}) do not "
                f"fit c of shape {tuple(c.shape)}: expected [..., {expected[0]}, 2, {across}] "
                f"summing {checked} entries; encode them from the same GEMM"
            )


def _check_operands_fit(c: Tensor, operands: GemmOperands) -> None:
    if not isinstance(operands, GemmOperands):
        raise TypeError(f"operands must be GemmOperands, got {type(operands).__name__}")
    a, b = operands.a, operands.b
    m, n = c.shape[-2:]
    if (
        a.dim() < 2
        or b.dim() < 2
        or a.shape[-2] != m
        or b.shape[-1] != n
        or a.shape[-1] != b.shape[-2]
    ):
        raise ValueError(
            f"operands a {tuple(a.shape)} and b {tuple(b.shape)} do not produce c of shape "
            f"{tuple(c.shape)}: need a [..., {m}, k] and b [..., k, {n}]"
        )
    if a.device != c.device or b.device != c.device:
        raise ValueError(f"operands are on {a.device}/{b.device} but c is on {c.device}")


def _check_references_finite(col: Checksums | None, row: Checksums | None) -> None:
    for name, ref in (("col", col), ("row", row)):
        if ref is not None and not bool(
            torch.isfinite(ref.sums).all() & torch.isfinite(ref.magnitude).all()
        ):
            raise ValueError(
                f"{name} reference checksums contain NaN or INF: the GEMM's inputs are already "
                "corrupted, so this output cannot be checked; protect the producer of the inputs"
            )
