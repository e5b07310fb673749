"""Launching the flash kernels: grids, the checksum vectors each launch needs, and the kernels'
arguments, on CUDA tensors compiled and on CPU tensors interpreted (megatron_abft.flash.build);
the tile shapes (megatron_abft.flash.tiles), tuned ones where a tuning file has them."""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.compiler.compiler import CompiledKernel

from megatron_abft.flash import build, checksums, kernels, tiles
from megatron_abft.flash.tiles import Blocks, padded_head_dim

TILE_C = {torch.float32: 64.0, torch.bfloat16: 64.0, torch.float16: 256.0}
"""The tile checks' bound is ``TILE_C[dtype] * threshold_scale * 2**-24 * mass`` (docs/abft.md
§8); tools/flash_false_alarms.py measures each check's largest clean residual against it, on
the CPU and, with ``--device cuda``, on a GPU's tensor cores. fp16 takes 4x: a tensor core adds
a step's 16 products aligned to the largest and truncated, and fp16's products carry 22
significant bits, 2 short of the fp32 accumulator's 24 (bf16's 16 leave 8), so rows that mix
large and small products lose low bits on nearly every term, up to about 17 units of 2**-23 a
step, 136 units of 2**-24 over a 64-deep tile. Measured on an H200: fp16's clean residuals up to
46 units, 2 of 3.0 million backward tiles above 64; bf16's at most 3.8 (docs/benchmarks.md)."""


TUNED = Path(__file__).with_name("tuned_tiles.json")
"""bf16's tiles timed on GPUs by tools/flash_tune.py, by device name (``ABFT_FLASH_TILES`` names
another file); where a device has none, tiles.TILES stand."""


@functools.cache
def tuned(device_name: str) -> dict[tuple[str, int], Blocks]:
    """The tuning file's tiles for GPUs named ``device_name``."""
    path = Path(os.environ.get("ABFT_FLASH_TILES", TUNED))
    if not path.exists():
        return {}
    table = json.loads(path.read_text()).get(device_name, {})
    made = {}
    for key, value in table.items():
        kernel, width = key.split("/")
        made[kernel, int(width)] = Blocks(*value)
    return made


def _gpu(device: torch.device) -> tuple[str, int]:
    """A CUDA ``device``'s name and its compute capability's major version."""
    return _asked(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _asked(index: int) -> tuple[str, int]:
    """_gpu of CUDA device ``index``, asked once: each ask costs the host microseconds, and a
    flash call asks six times."""
    return torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index)[0]


def blocks(
    kernel: str, head_dim: int, dtype: torch.dtype, device: torch.device | None = None
) -> Blocks:
    """The tile shape ``kernel`` launches with for a padded ``head_dim`` and input ``dtype``: a
    tuned one for bf16 on a CUDA ``device`` where the tuning file has it, else tiles.blocks."""
    if device is not None and device.type == "cuda" and dtype == torch.bfloat16:
        found = tuned(_gpu(device)[0]).get((kernel, head_dim))
        if found is not None:
            return found
    return tiles.blocks(kernel, head_dim, dtype)


# --- launches --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Checks:
    """What a call checks and how strictly."""

    due: int
    """Bit i set: section FLASH_SECTIONS[i] is checked on this call."""
    tol: float
    """``c * 2**-24``: the tile checks' bound per unit of mass."""
    near_inf: float
    """Residuals above this count as near-INF faults."""

    def has(self, *sections: tl.constexpr) -> bool:
        """Whether any of the kernels' ``sections`` (kernels.SCORES...) is due."""
        return self.due & section_bits(*sections) != 0

    def kernel_due(self, kernel: str) -> bool:
        """Whether any of ``kernel``'s sections (KERNEL_SECTIONS) is due."""
        return self.due & KERNEL_BITS[kernel] != 0


def section_bits(*sections: tl.constexpr) -> int:
    """The ``due`` bits of the kernels' ``sections`` (kernels.SCORES...), from their values:
    hashing Triton's constexpr wrappers costs the host more than the bits themselves."""
    bits = 0
    for section in sections:
        bits |= 1 << section.value
    return bits


KERNEL_SECTIONS = {
    "forward": (kernels.SCORES, kernels.CONTEXT),
    "dkdv": (kernels.BWD_SCORES, kernels.GRAD_PROBS, kernels.GRAD_V, kernels.GRAD_K),
    "dq": (kernels.BWD_SCORES, kernels.GRAD_PROBS, kernels.GRAD_Q),
}
"""The sections each kernel checks: one with none of them due runs with the checks compiled
out, and makes no checksum vectors."""
KERNEL_BITS = {kernel: section_bits(*sections) for kernel, sections in KERNEL_SECTIONS.items()}
"""KERNEL_SECTIONS as ``due`` bits."""


def _cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` of ints (``triton.cdiv`` unwraps constexprs on every host call)."""
    return -(-a // b)


@dataclass
class Findings:
    """What one call's checks found, on the device, in one int32 buffer (``buffer``): for each
    section and (batch, head) matrix ``codes``, and the first flagged row and column (as
    ``kernels.NO_ROW - row``, 0 none) as kernels.py describes them; then ``done``, the count of
    the programs of the call's last launch, whose last folds the findings into the ledger
    (kernels._record); then three counters a matrix of each head's programs of the checksum
    tiles (the forward's; the backward's query tiles, and dQ's tiles of K and V), whose last
    adds up the head's sums (checksums._head_done). In calibration runs, ``ratio``: the largest
    clean residual ratio."""

    buffer: Tensor
    matrices: int
    """0 where the call checks nothing (``buffer`` a placeholder)."""
    ratio: Tensor | None = None

    @property
    def arguments(self) -> tuple[Tensor, Tensor]:
        """FOUND and RATIO as the kernels take them (RATIO a placeholder when off)."""
        return self.buffer, self.ratio if self.ratio is not None else self.buffer

    @property
    def codes(self) -> Tensor:
        return self._found(0)

    @property
    def rows(self) -> Tensor:
        return self._found(1)

    @property
    def cols(self) -> Tensor:
        return self._found(2)

    def _found(self, part: int) -> Tensor:
        size = kernels.N_SECTIONS.value * self.matrices
        return self.buffer[part * size : (part + 1) * size].view(-1, self.matrices)

    @classmethod
    def empty(cls, matrices: int, device: torch.device, calibrate: bool = False) -> Findings:
        """Nothing found yet, in one zeroed buffer (one launch)."""
        size = kernels.N_SECTIONS.value * matrices
        buffer = torch.zeros(3 * size + 1 + 3 * matrices, dtype=torch.int32, device=device)
        ratio = None
        if calibrate:
            ratio = torch.zeros(size, dtype=torch.float32, device=device).view(-1, matrices)
        return cls(buffer, matrices, ratio)

    def counters(self, tiles: int) -> Tensor | None:
        """The per-head counters of checksum tiles ``tiles``: 0 the forward's, 1 the
        backward's query tiles', 2 dQ's tiles of K and V (one Findings may serve both ops);
        None where the call checks nothing."""
        if not self.matrices:
            return None
        at = 3 * kernels.N_SECTIONS.value * self.matrices + 1 + tiles * self.matrices
        return self.buffer[at : at + self.matrices]

    @classmethod
    def unchecked(cls, device: torch.device) -> Findings:
        """Placeholders for a call that checks nothing (no launch)."""
        return cls(checksums.placeholder(torch.int32, device), 0)


def forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    scale: float,
    checks: Checks,
    found: Findings,
    ledger: tuple[Tensor, Tensor, Tensor, Tensor] | None = None,
    inject: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """O [B, H, Nq, D] (laid out as q, or as its TMA-ready copy) and LSE [B, H, rows] (fp32, log2
    units; ``rows``: Nq padded to checksums.ROWS, finite past Nq). What the checks find is in
    ``found``, and, given a ``ledger`` (its tensors: counts, clock, log, logged;
    megatron_abft.flash.ledger), folded into it by the last launch."""
    q, k, v = (tma_ready(t) for t in (q, k, v))
    batch, heads, n_q, dim = q.shape
    kv_heads, n_k = k.shape[1], k.shape[2]
    width = padded_head_dim(dim)
    tile = blocks("forward", width, q.dtype, q.device)
    o = torch.empty_like(q)
    rows = _cdiv(n_q, checksums.ROWS) * checksums.ROWS
    lse = torch.empty(batch, heads, rows, dtype=torch.float32, device=q.device)
    made = checksums.key_value_sums(
        k, v, tile.block_n, width, checks.has(kernels.SCORES), False,
        checks.has(kernels.CONTEXT), _slack(k.dtype, checks), found.counters(0),
    )  # fmt: skip
    kc, _, vr = _sums_arguments(made, k)
    grid = (_cdiv(n_q, tile.block_m), batch * heads)
    # fmt: off
    _twice(
        build.for_device(kernels, q.device)._fwd_kernel, grid,
        q, k, v, o, lse, *kc, *vr, *found.arguments, _fault(inject, q.device),
        _flags(grid, checks, "forward", q.device), *_ledger_args(found, ledger),
        scale * math.log2(math.e), checks.tol, checks.near_inf,
        *_rows(q), *_rows(k), *_rows(v), *_rows(o),
        heads, heads // kv_heads, n_q, n_k, dim, rows,
        **_constants("forward", tile, width, causal, checks, found, inject, q),
        record=ledger is not None,
    )
    # fmt: on
    return o, lse


def backward(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    causal: bool,
    scale: float,
    checks: Checks,
    found: Findings,
    ledger: tuple[Tensor, Tensor, Tensor, Tensor] | None = None,
    inject: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """dQ, dK, dV, laid out as q, k and v (or as their TMA-ready copies); the findings into
    ``ledger``'s tensors, as the forward's."""
    do, q, k, v, o = (tma_ready(t) for t in (do, q, k, v, o))
    batch, heads, n_q, dim = q.shape
    kv_heads, n_k = k.shape[1], k.shape[2]
    width = padded_head_dim(dim)
    module = build.for_device(kernels, q.device)
    tile, dq_tile = (blocks(kernel, width, q.dtype, q.device) for kernel in ("dkdv", "dq"))
    # K's row sums check dQ; their largest row norm, with V's, bounds sum P = 1 and sum dS = 0
    identities = checks.has(kernels.BWD_SCORES, kernels.GRAD_PROBS)
    keys = None  # where the backward checks nothing, Delta's launch takes no work of K's
    if checks.kernel_due("dkdv") or checks.kernel_due("dq"):
        keys = checksums.key_value_work(
            k, v, dq_tile.block_n, width, False, identities or checks.has(kernels.GRAD_Q),
            checks.has(kernels.GRAD_PROBS), _slack(k.dtype, checks), found.counters(2),
        )  # fmt: skip
    # Delta, its rounding (for sum dS = 0, grad_probs), dK/dV's checksum tiles and dQ's (keys):
    # one launch
    made = checksums.backward(
        o, do, q, tile.block_m, width,
        odo=checks.has(kernels.GRAD_PROBS),
        rows=checks.has(kernels.GRAD_V, kernels.GRAD_K),
        queries=checks.has(kernels.GRAD_K),
        columns=checks.has(kernels.BWD_SCORES, kernels.GRAD_PROBS),
        slack=_slack(q.dtype, checks), done=found.counters(1), keys=keys,
    )  # fmt: skip
    delta, odo = made.delta, made.odo
    rows = delta.shape[-1]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    group = heads // kv_heads
    if group > 1:  # each query head's share of dK and dV, summed over its group after
        shape = (batch, heads, n_k, dim)
        dk_heads, dv_heads = (q.new_empty(shape, dtype=torch.float32) for _ in "kv")
    else:
        dk_heads, dv_heads = dk, dv
    fault = _fault(inject, q.device)
    qk_scale = scale * math.log2(math.e)
    # fmt: off
    grid = (_cdiv(n_k, tile.block_n), batch * heads)
    _twice(
        module._bwd_dkdv_kernel, grid,
        q, k, v, do, lse, delta, dk_heads, dv_heads,
        made.rows, made.columns, made.stats, *found.arguments, fault,
        _flags(grid, checks, "dkdv", q.device), *_ledger_args(found, ledger),
        qk_scale, scale, checks.tol, checks.near_inf,
        *_rows(q), *_rows(k), *_rows(v), *_rows(do), *_rows(dk_heads), *_rows(dv_heads),
        heads, group, n_q, n_k, dim, rows,
        **_constants("dkdv", tile, width, causal, checks, found, inject, q),
        record=ledger is not None and not checks.kernel_due("dq"),  # dQ checks nothing
    )
    # fmt: on
    if group > 1:
        dk.copy_(dk_heads.view(batch, kv_heads, group, n_k, dim).sum(2))
        dv.copy_(dv_heads.view(batch, kv_heads, group, n_k, dim).sum(2))
    tile = dq_tile
    _, kr, vr = _sums_arguments(keys.made if keys else (None, None, None), k)
    # fmt: off
    grid = (_cdiv(n_q, tile.block_m), batch * heads)
    _twice(
        module._bwd_dq_kernel, grid,
        q, k, v, do, lse, delta, odo, dq, *kr, vr[1], *found.arguments, fault,
        _flags(grid, checks, "dq", q.device), *_ledger_args(found, ledger),
        qk_scale, scale, checks.tol, unit_roundoff(o.dtype), checks.near_inf,
        *_rows(q), *_rows(k), *_rows(v), *_rows(do), *_rows(dq),
        heads, heads // kv_heads, n_q, n_k, dim, rows,
        **_constants("dq", tile, width, causal, checks, found, inject, q),
        record=ledger is not None,
    )
    # fmt: on
    return dq, dk, dv


def _flags(grid: tuple[int, int], checks: Checks, kernel: str, device: torch.device) -> Tensor:
    """A checked launch's AGAIN: a flag a program, each written by its program's first pass
    (so no fill); a placeholder where the launch checks nothing."""
    if not checks.kernel_due(kernel):
        return checksums.placeholder(torch.int32, device)
    return torch.empty(grid[0] * grid[1], dtype=torch.int32, device=device)


def _twice(kernel, grid: tuple[int, int], *args, record: bool, **constants) -> None:
    """Launch an attention kernel, and, where it checks, launch it again in its RETRY mode:
    the programs whose first pass flagged (each sets its flag in AGAIN, on the device) compute
    their block again, the others return at once; with ``record`` (the call's last launch)
    its last program then folds the call's findings into the ledger.

    The second launch takes the first's arguments, so Triton's launcher would specialise them
    again to the same key: once its compiled kernel is known (RETRIES), it is launched
    directly, without the binder (about 40 us a launch on the CPU machine's host,
    tools/bench_host.py)."""
    if args[0].device.type == "cuda" and constants["TMA"]:
        _scratch_allocator()
    first = kernel[grid](*args, RETRY=False, RECORD=False, **constants)
    if constants["DUE"] == 0:
        return
    again = {**constants, "RETRY": True, "RECORD": record}
    known = RETRIES.get((first, record)) if isinstance(first, CompiledKernel) else None
    if known is not None:
        known[grid](*bound_arguments(kernel, args, again))
        return
    retry = kernel[grid](*args, **again)
    if isinstance(first, CompiledKernel) and isinstance(retry, CompiledKernel):
        RETRIES[first, record] = retry


RETRIES: dict[tuple[CompiledKernel, bool], CompiledKernel] = {}
"""The second (RETRY) launch's compiled kernel, by the first launch's and RECORD: the first's
compiled kernel stands for its key (the arguments' specialisation, the constexprs and the
options), which the second shares but for RETRY and RECORD."""


def bound_arguments(kernel, args: tuple, kwargs: dict) -> list:
    """A launch's arguments as Triton's binder hands them to a compiled kernel: every parameter
    of ``kernel`` in its order, the constexprs among them (from ``kwargs``, else their
    defaults); the launch options (num_warps...) are not parameters."""
    parameters = list(kernel.signature.parameters.values())[len(args) :]
    return [*args, *(kwargs.get(p.name, p.default) for p in parameters)]


def _ledger_args(found: Findings, ledger: tuple[Tensor, ...] | None) -> tuple:
    """COUNTS, CLOCK, LOG, LOGGED, CAPACITY, FIELDS as the kernels take them (placeholders
    without a ledger: nothing records)."""
    if ledger is None:
        nothing = found.buffer
        return nothing, nothing, nothing, nothing, 0, 0
    counts, clock, log, logged = ledger
    return counts, clock, log, logged, log.shape[1], log.shape[2]


def _scratch(size: int, alignment: int, stream: int | None) -> Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _scratch_allocator() -> None:
    """The kernels make their TMA descriptors on the device, in global scratch memory that
    Triton asks its allocator for at each launch: where none is set (in this thread: autograd's
    backward runs in threads of its own), PyTorch's caching allocator serves it."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)


def tma(device: torch.device) -> bool:
    """Whether the kernels move tiles by TMA descriptors on ``device``: on GPUs that have TMA
    (Hopper and later) and in Triton's interpreter, which runs them too; on older GPUs (A100)
    they load through masked pointers."""
    if device.type != "cuda":
        return True
    return _gpu(device)[1] >= 9


def _rows(x: Tensor) -> tuple[int, int, int]:
    """The batch, head and row strides of ``x`` [batch, heads, seq, dim], as the attention
    kernels take them: its last dim is contiguous (``tma_ready``; outputs made like it)."""
    return x.stride()[:3]


def tma_ready(x: Tensor) -> Tensor:
    """``x`` [batch, heads, seq, dim] as TMA descriptors take it: its last dim contiguous, its
    base and other strides multiples of 16 bytes; a copy (the last dim padded) where it is not.
    Megatron's layouts need none."""
    unit = 16 // x.element_size()
    sb, sh, sn, sd = x.stride()  # unpacked: called 8 times a flash call
    if sd == 1 and not (x.data_ptr() % 16 or sb % unit or sh % unit or sn % unit):
        return x
    padded = -(-x.shape[-1] // unit) * unit
    copy = x.new_zeros(*x.shape[:-1], padded)
    copy[..., : x.shape[-1]] = x
    return copy[..., : x.shape[-1]]


def _slack(dtype: torch.dtype, checks: Checks) -> float:
    """What the checksum vectors widen a row's absolute sum by, in units of its scale, so that
    the tiles' bound covers what scaled parts lose (checksums.PART_LOSS; 0 unscaled)."""
    return checksums.PART_LOSS / checks.tol if checksums.HEADROOM.get(dtype, 0) else 0.0


def _sums_arguments(
    made: tuple[checksums.Sums | None, ...], like: Tensor
) -> tuple[tuple[Tensor, Tensor], ...]:
    """Checksum vectors (checksums.key_value_sums') as kernel arguments, parts and stats,
    placeholders for a kind not made."""
    nothing = checksums.placeholder(like.dtype, like.device)
    return tuple((s.parts, s.stats) if s else (nothing, nothing) for s in made)


def _constants(
    kernel: str,
    tile: Blocks,
    width: int,
    causal: bool,
    checks: Checks,
    found: Findings,
    inject: Tensor | None,
    q: Tensor,
) -> dict:
    """A launch's constexprs and launch options."""
    return {
        "BLOCK_M": tile.block_m,
        "BLOCK_N": tile.block_n,
        "HEAD_DIM": width,
        "CAUSAL": causal,
        "DUE": checks.due & KERNEL_BITS[kernel],
        "SCALED": checksums.HEADROOM.get(q.dtype, 0) != 0,
        "INJECT": inject is not None,
        "CALIBRATE": found.ratio is not None,
        "TMA": tma(q.device),
        "num_warps": tile.num_warps,
        "num_stages": tile.num_stages,
        **({"maxnreg": tile.maxnreg} if tile.maxnreg else {}),
    }


def _fault(inject: Tensor | None, device: torch.device) -> Tensor:
    """The kernels' INJ argument: the armed fault, or a placeholder (INJECT off)."""
    return inject if inject is not None else checksums.placeholder(torch.int32, device)


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the distance from 1 to the next number of ``dtype``."""
    return torch.finfo(dtype).eps / 2
