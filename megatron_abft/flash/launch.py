"""Launching the flash kernels: tile shapes, grids, the checksum vectors each launch needs, and
the kernels' arguments, on CUDA tensors compiled and on CPU tensors interpreted
(megatron_abft.flash.build)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
from torch import Tensor

from megatron_abft.flash import build, checksums, kernels

DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
"""Input dtypes the kernels take; they accumulate in fp32 whatever the input."""
GPU_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)
"""Input dtypes the kernels take on GPUs. fp32 operands would take 3xTF32 MMAs to keep the
checks' fp32 bound, and no tile shape of those builds without spilling registers (measured by
tools/flash_aot.py): fp32 runs in the interpreter only, as FlashAttention takes no fp32."""
HEAD_DIMS: tuple[int, ...] = (64, 128)
"""Head widths the kernels are built for; a narrower head is padded to the next."""
KERNELS: tuple[str, ...] = ("forward", "dkdv", "dq")

TILE_C = {torch.float32: 64.0, torch.bfloat16: 64.0, torch.float16: 256.0}
"""The tile checks' bound is ``TILE_C[dtype] * threshold_scale * 2**-24 * mass`` (docs/abft.md
§8); tools/flash_false_alarms.py measures each check's largest clean residual against it, on
the CPU and, with ``--device cuda``, on a GPU's tensor cores. fp16 takes 4x: a tensor core adds
a step's 16 products aligned to the largest and truncated, and fp16's products carry 22
significant bits, 2 short of the fp32 accumulator's 24 (bf16's 16 leave 8), so rows that mix
large and small products lose low bits on nearly every term, up to about 17 units of 2**-23 a
step, 136 units of 2**-24 over a 64-deep tile. Measured on an H200: fp16's clean residuals up to
46 units, 2 of 3.0 million backward tiles above 64; bf16's at most 3.8 (docs/benchmarks.md)."""


@dataclass(frozen=True)
class Blocks:
    """The tile shape and launch options of one kernel."""

    block_m: int
    """Query rows a tile."""
    block_n: int
    """Key rows a tile."""
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class Budget:
    """What the static gate allows a production kernel on sm_90 (megatron_abft.flash.aot,
    tests/flash/test_flash_gate.py): issue slots per element of S in its interior loop with
    the checks compiled out, and what the checks may add there."""

    slots: float
    checked: float


TILES: dict[tuple[str, int], Blocks] = {
    ("forward", 64): Blocks(128, 64, 8, 3),
    ("forward", 128): Blocks(128, 64, 8, 2),
    ("dkdv", 64): Blocks(64, 128, 8, 2),
    ("dkdv", 128): Blocks(32, 128, 8, 2),
    ("dq", 64): Blocks(128, 64, 8, 2),
    ("dq", 128): Blocks(128, 32, 8, 2),
}
"""Tile shapes by kernel and head width, for bf16 and fp16 (the same for both), chosen from the
checked and unchecked builds on sm_90 (``python -m tools.flash_sass``): every main GEMM on
wgmma, no spills. For dK/dV, block_m is the query block it streams and block_n the key block it
holds; in dQ and the forward, block_m is the query block held. A tuning file (``tuned``) may
replace them on a GPU."""
BUDGETS: dict[tuple[str, int], Budget] = {
    ("forward", 64): Budget(10, 2),
    ("forward", 128): Budget(14, 2),
    ("dkdv", 64): Budget(16, 4),
    ("dkdv", 128): Budget(20, 4),
    ("dq", 64): Budget(14, 4),
    ("dq", 128): Budget(16, 4),
}
"""The gate's budgets for TILES (issue slots per element of S, interior loop, sm_90)."""
INTERPRETED = Blocks(64, 64, 4, 2)
"""fp32's tiles: it runs in the interpreter only (GPU_DTYPES), where larger tiles run faster."""


def blocks(kernel: str, head_dim: int, dtype: torch.dtype) -> Blocks:
    """The tile shape ``kernel`` launches with for a padded ``head_dim`` and input ``dtype``."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown flash kernel {kernel!r}; choose from {', '.join(KERNELS)}")
    if dtype not in GPU_DTYPES:
        return INTERPRETED
    return TILES[kernel, head_dim]


def padded_head_dim(head_dim: int) -> int:
    """The kernels' width for ``head_dim``: the smallest of HEAD_DIMS that holds it."""
    for width in HEAD_DIMS:
        if head_dim <= width:
            return width
    raise ValueError(
        f"flash attention: head dim {head_dim} is above the largest the kernels take "
        f"({HEAD_DIMS[-1]}); use the unfused attention (attention='unfused') for wider heads"
    )


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

    def has(self, *sections: int) -> bool:
        """Whether any of the kernels' ``sections`` (kernels.SCORES...) is due."""
        return any(self.due >> int(s) & 1 for s in sections)


KERNEL_SECTIONS = {
    "forward": (kernels.SCORES, kernels.CONTEXT),
    "dkdv": (kernels.BWD_SCORES, kernels.GRAD_PROBS, kernels.GRAD_V, kernels.GRAD_K),
    "dq": (kernels.BWD_SCORES, kernels.GRAD_PROBS, kernels.GRAD_Q),
}
"""The sections each kernel checks: one with none of them due runs with the checks compiled
out, and makes no checksum vectors."""


@dataclass
class Found:
    """What one launch's checks found, one entry a section and (batch, head) matrix, on the
    device: ``codes``, and the first flagged row and column (as ``kernels.NO_ROW - row``, 0
    none) as kernels.py describes them, and, in calibration runs, the largest clean residual
    ratio."""

    codes: Tensor
    rows: Tensor
    cols: Tensor
    ratio: Tensor | None = None

    @property
    def arguments(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """CODES, ROWS, COLS, RATIO as the kernels take them (RATIO a placeholder when off)."""
        ratio = self.ratio if self.ratio is not None else self.codes
        return self.codes, self.rows, self.cols, ratio

    @classmethod
    def empty(cls, matrices: int, device: torch.device, calibrate: bool = False) -> Found:
        """Nothing found yet, in one zeroed buffer (one launch)."""
        shape = (kernels.N_SECTIONS.value, matrices)
        codes, rows, cols = torch.zeros(3, *shape, dtype=torch.int32, device=device)
        ratio = torch.zeros(shape, dtype=torch.float32, device=device) if calibrate else None
        return cls(codes, rows, cols, ratio)

    @classmethod
    def unchecked(cls, device: torch.device) -> Found:
        """Placeholders for a call that checks nothing (no launch)."""
        nothing = torch.empty(0, dtype=torch.int32, device=device)
        return cls(nothing, nothing, nothing)


def forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    scale: float,
    checks: Checks,
    found: Found,
    inject: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """O [B, H, Nq, D] (laid out as q) and LSE [B, H, Nq] (fp32, log2 units)."""
    batch, heads, n_q, dim = q.shape
    kv_heads, n_k = k.shape[1], k.shape[2]
    width = padded_head_dim(dim)
    tiles = blocks("forward", width, q.dtype)
    o = torch.empty_like(q)
    lse = torch.empty(batch, heads, n_q, dtype=torch.float32, device=q.device)
    kc, _ = _sums(k, tiles.block_n, width, checks.has(kernels.SCORES), False)
    _, vr = _sums(v, tiles.block_n, width, False, checks.has(kernels.CONTEXT))
    grid = (triton.cdiv(n_q, tiles.block_m), batch * heads)
    # fmt: off
    _twice(
        build.for_device(kernels, q.device)._fwd_kernel, grid,
        q, k, v, o, lse, *kc, *vr, *found.arguments, _fault(inject, q.device),
        _flags(grid, checks, "forward", q.device),
        scale * math.log2(math.e), checks.tol, checks.near_inf,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        heads, heads // kv_heads, n_q, n_k, dim,
        **_constants("forward", tiles, width, causal, checks, found, inject, q, n_q, n_k),
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
    found: Found,
    inject: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """dQ, dK, dV, laid out as q, k and v."""
    batch, heads, n_q, dim = q.shape
    kv_heads, n_k = k.shape[1], k.shape[2]
    width = padded_head_dim(dim)
    module = build.for_device(kernels, q.device)
    delta = torch.empty(batch, heads, n_q, dtype=torch.float32, device=q.device)
    # the rounding of the stored O in Delta, for sum dS = 0 (grad_probs)
    with_odo = checks.has(kernels.GRAD_PROBS)
    odo = torch.empty_like(delta) if with_odo else delta
    block = 64
    # fmt: off
    module._delta_kernel[(triton.cdiv(n_q, block), batch * heads)](
        o, do, delta, odo, *o.stride(), *do.stride(), heads, n_q, dim,
        BLOCK_M=block, HEAD_DIM=width, WITH_ODO=with_odo, num_warps=4, num_stages=1,
    )
    # fmt: on
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    fault = _fault(inject, q.device)
    qk_scale = scale * math.log2(math.e)
    tiles = blocks("dkdv", width, q.dtype)
    qc, qr = _sums(
        q, tiles.block_m, width, checks.has(kernels.BWD_SCORES), checks.has(kernels.GRAD_K)
    )
    doc, dor = _sums(
        do, tiles.block_m, width, checks.has(kernels.GRAD_PROBS), checks.has(kernels.GRAD_V)
    )
    # fmt: off
    grid = (triton.cdiv(n_k, tiles.block_n), batch * kv_heads)
    _twice(
        module._bwd_dkdv_kernel, grid,
        q, k, v, do, lse, delta, dk, dv, *qc, *qr, *doc, *dor, *found.arguments, fault,
        _flags(grid, checks, "dkdv", q.device),
        qk_scale, scale, checks.tol, checks.near_inf,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(),
        heads, heads // kv_heads, n_q, n_k, dim,
        **_constants("dkdv", tiles, width, causal, checks, found, inject, q, n_q, n_k),
    )
    # fmt: on
    tiles = blocks("dq", width, q.dtype)
    # K's row sums check dQ; their largest row norm, with V's, bounds sum P = 1 and sum dS = 0
    identities = checks.has(kernels.BWD_SCORES, kernels.GRAD_PROBS)
    _, kr = _sums(k, tiles.block_n, width, False, identities or checks.has(kernels.GRAD_Q))
    _, vr = _sums(v, tiles.block_n, width, False, checks.has(kernels.GRAD_PROBS))
    # fmt: off
    grid = (triton.cdiv(n_q, tiles.block_m), batch * heads)
    _twice(
        module._bwd_dq_kernel, grid,
        q, k, v, do, lse, delta, odo, dq, *kr, vr[1], *found.arguments, fault,
        _flags(grid, checks, "dq", q.device),
        qk_scale, scale, checks.tol, unit_roundoff(o.dtype), checks.near_inf,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(),
        heads, heads // kv_heads, n_q, n_k, dim,
        **_constants("dq", tiles, width, causal, checks, found, inject, q, n_q, n_k),
    )
    # fmt: on
    return dq, dk, dv


def _flags(grid: tuple[int, int], checks: Checks, kernel: str, device: torch.device) -> Tensor:
    """A checked launch's AGAIN: a flag a program, each written by its program's first pass
    (so no fill); a placeholder where the launch checks nothing."""
    checked = checks.has(*KERNEL_SECTIONS[kernel])
    return torch.empty(grid[0] * grid[1] if checked else 0, dtype=torch.int32, device=device)


def _twice(kernel, grid: tuple[int, int], *args, **constants) -> None:
    """Launch an attention kernel, and, where it checks, launch it again in its RETRY mode:
    the programs whose first pass flagged (each sets its flag in AGAIN, on the device) compute
    their block again, the others return at once."""
    kernel[grid](*args, RETRY=False, **constants)
    if constants["DUE"] != 0:
        kernel[grid](*args, RETRY=True, **constants)


def _sums(
    x: Tensor, block: int, width: int, columns: bool, rows: bool
) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """``x``'s column and row sums (checksums.sums) as kernel arguments, parts and stats,
    placeholders for a kind not asked for; one launch when either is."""
    made = checksums.sums(x, block, width, columns, rows) if columns or rows else (None, None)
    placeholder = torch.empty(0, dtype=x.dtype, device=x.device)
    return tuple((s.parts, s.stats) if s else (placeholder, placeholder) for s in made)


def _constants(
    kernel: str,
    tiles: Blocks,
    width: int,
    causal: bool,
    checks: Checks,
    found: Found,
    inject: Tensor | None,
    q: Tensor,
    n_q: int,
    n_k: int,
) -> dict:
    """A launch's constexprs and launch options."""
    even = n_q % tiles.block_m == 0 and n_k % tiles.block_n == 0 and q.shape[-1] == width
    return {
        "BLOCK_M": tiles.block_m,
        "BLOCK_N": tiles.block_n,
        "HEAD_DIM": width,
        "CAUSAL": causal,
        "EVEN": even,
        "DUE": checks.due & sum(1 << int(s) for s in KERNEL_SECTIONS[kernel]),
        "SCALED": checksums.HEADROOM.get(q.dtype, 0) != 0,
        "INJECT": inject is not None,
        "CALIBRATE": found.ratio is not None,
        "num_warps": tiles.num_warps,
        "num_stages": tiles.num_stages,
    }


def _fault(inject: Tensor | None, device: torch.device) -> Tensor:
    """The kernels' INJ argument: the armed fault, or a placeholder (INJECT off)."""
    return inject if inject is not None else torch.empty(0, dtype=torch.int32, device=device)


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the distance from 1 to the next number of ``dtype``."""
    return torch.finfo(dtype).eps / 2
