"""Launching the flash kernels: tile shapes, grids, the checksum vectors each launch needs, and
the kernels' arguments, on CUDA tensors compiled and on CPU tensors interpreted
(megatron_abft.flash.build)."""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from torch import Tensor

from megatron_abft.flash import build, checksums, kernels

DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
"""Input dtypes the kernels take; they accumulate in fp32 whatever the input."""
GPU_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)
"""Input dtypes the kernels take on GPUs. fp32 operands would take 3xTF32 MMAs to keep the
checks' fp32 bound, and no tile shape of those built without spilling registers when it was
tried: fp32 runs in the interpreter only, as FlashAttention takes no fp32."""
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
    maxnreg: int | None = None
    """Registers a thread ptxas may use (None: its own choice)."""


@dataclass(frozen=True)
class Budget:
    """What the static gate allows a production kernel on sm_90 (megatron_abft.flash.aot,
    tests/flash/test_flash_gate.py), in its interior loop: issue slots per element of S with
    the checks compiled out, what the checks may add to them, and the registers a thread the
    checks may add (CTAs per SM must not drop, nothing may spill). The targets
    (docs/benchmarks.md) are 10/14 (forward), 16/20 (dK/dV), 14/16 (dQ) slots at head dims
    64/128, checks +2 forward and +4 backward, +32 registers; where a kernel does not reach one
    yet, its budget is what it reaches."""

    slots: float
    checked: float
    registers: int = 32


TILES: dict[tuple[str, int], Blocks] = {
    ("forward", 64): Blocks(128, 128, 8, 2),
    ("forward", 128): Blocks(128, 128, 8, 2),
    ("dkdv", 64): Blocks(64, 128, 8, 2),
    ("dkdv", 128): Blocks(32, 128, 8, 2),
    ("dq", 64): Blocks(128, 128, 8, 2),
    ("dq", 128): Blocks(64, 64, 4, 2),
}
"""Tile shapes by kernel and head width, for bf16 and fp16 (the same for both), chosen from the
checked and unchecked builds on sm_90 (``python -m tools.flash_sass``): every main GEMM on
wgmma with M >= 64 a warpgroup, no spills, the checked kernel on as many CTAs an SM as the
unchecked, the fewest issue slots. For dK/dV, block_m is the query block it streams and block_n
the key block it holds; in dQ and the forward, block_m is the query block held. A tuning file
(``tuned``) may replace them on a GPU."""
FP16_TILES: dict[tuple[str, int], Blocks] = {("dkdv", 128): Blocks(16, 128, 8, 2)}
"""fp16's own tiles where TILES spill for it: its checksum tiles carry a scale a tile (bf16's
need none), whose loads in the loop take registers."""
BUDGETS: dict[tuple[str, int], Budget] = {
    ("forward", 64): Budget(10, 2, registers=64),
    ("forward", 128): Budget(14, 2, registers=64),
    ("dkdv", 64): Budget(16, 4, registers=80),
    ("dkdv", 128): Budget(20, 5, registers=48),
    ("dq", 64): Budget(14, 4, registers=72),
    ("dq", 128): Budget(16, 4.2, registers=80),
}
"""The gate's budgets for TILES (sm_90, bf16 and fp16, causal or not)."""
FP16_BUDGETS: dict[tuple[str, int], Budget] = {("dkdv", 128): Budget(25, 8.7, registers=64)}
"""The budgets of FP16_TILES (dK's bound there adds a floor for subnormal P~, summed after the
loop, and the loop holds dV's and dK's checksum tile across dP^T: registers, the kernel on one
CTA an SM either way)."""


def budget(kernel: str, head_dim: int, dtype: torch.dtype) -> Budget:
    """The gate's budget for the tiles ``blocks`` gives."""
    if dtype == torch.float16 and (kernel, head_dim) in FP16_BUDGETS:
        return FP16_BUDGETS[kernel, head_dim]
    return BUDGETS[kernel, head_dim]


INTERPRETED = Blocks(64, 64, 4, 2)
"""fp32's tiles: it runs in the interpreter only (GPU_DTYPES), where larger tiles run faster."""


TUNED = Path(__file__).with_name("tuned_tiles.json")
"""bf16's tiles timed on GPUs by tools/flash_tune.py, by device name (``ABFT_FLASH_TILES`` names
another file); where a device has none, TILES stand."""


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


def blocks(
    kernel: str, head_dim: int, dtype: torch.dtype, device: torch.device | None = None
) -> Blocks:
    """The tile shape ``kernel`` launches with for a padded ``head_dim`` and input ``dtype`` (bf16
    on a CUDA ``device``: a tuned one where the tuning file has it)."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown flash kernel {kernel!r}; choose from {', '.join(KERNELS)}")
    if dtype not in GPU_DTYPES:
        return INTERPRETED
    if dtype == torch.float16 and (kernel, head_dim) in FP16_TILES:
        return FP16_TILES[kernel, head_dim]
    if device is not None and device.type == "cuda" and dtype == torch.bfloat16:
        found = tuned(torch.cuda.get_device_name(device)).get((kernel, head_dim))
        if found is not None:
            return found
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
class Findings:
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
    def empty(cls, matrices: int, device: torch.device, calibrate: bool = False) -> Findings:
        """Nothing found yet, in one zeroed buffer (one launch)."""
        shape = (kernels.N_SECTIONS.value, matrices)
        codes, rows, cols = torch.zeros(3, *shape, dtype=torch.int32, device=device)
        ratio = torch.zeros(shape, dtype=torch.float32, device=device) if calibrate else None
        return cls(codes, rows, cols, ratio)

    @classmethod
    def unchecked(cls, device: torch.device) -> Findings:
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
    found: Findings,
    inject: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """O [B, H, Nq, D] (laid out as q, or as its TMA-ready copy) and LSE [B, H, rows] (fp32, log2
    units; ``rows``: Nq padded to checksums.ROWS, finite past Nq)."""
    q, k, v = (tma_ready(t) for t in (q, k, v))
    batch, heads, n_q, dim = q.shape
    kv_heads, n_k = k.shape[1], k.shape[2]
    width = padded_head_dim(dim)
    tiles = blocks("forward", width, q.dtype, q.device)
    o = torch.empty_like(q)
    rows = triton.cdiv(n_q, checksums.ROWS) * checksums.ROWS
    lse = torch.empty(batch, heads, rows, dtype=torch.float32, device=q.device)
    kc, _, vr = _key_value_sums(
        k, v, tiles.block_n, width, checks.has(kernels.SCORES), False, checks.has(kernels.CONTEXT)
    )
    grid = (triton.cdiv(n_q, tiles.block_m), batch * heads)
    # fmt: off
    _twice(
        build.for_device(kernels, q.device)._fwd_kernel, grid,
        q, k, v, o, lse, *kc, *vr, *found.arguments, _fault(inject, q.device),
        _flags(grid, checks, "forward", q.device),
        scale * math.log2(math.e), checks.tol, checks.near_inf,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        heads, heads // kv_heads, n_q, n_k, dim, rows,
        **_constants("forward", tiles, width, causal, checks, found, inject, q),
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
    inject: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """dQ, dK, dV, laid out as q, k and v (or as their TMA-ready copies)."""
    do, q, k, v, o = (tma_ready(t) for t in (do, q, k, v, o))
    batch, heads, n_q, dim = q.shape
    kv_heads, n_k = k.shape[1], k.shape[2]
    width = padded_head_dim(dim)
    module = build.for_device(kernels, q.device)
    tiles = blocks("dkdv", width, q.dtype, q.device)
    # Delta, its rounding (for sum dS = 0, grad_probs) and dK/dV's checksum tiles: one launch
    made = checksums.backward(
        o, do, q, tiles.block_m, width,
        odo=checks.has(kernels.GRAD_PROBS),
        rows=checks.has(kernels.GRAD_V, kernels.GRAD_K),
        queries=checks.has(kernels.GRAD_K),
        columns=checks.has(kernels.BWD_SCORES, kernels.GRAD_PROBS),
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
    grid = (triton.cdiv(n_k, tiles.block_n), batch * heads)
    _twice(
        module._bwd_dkdv_kernel, grid,
        q, k, v, do, lse, delta, dk_heads, dv_heads,
        made.rows, made.columns, made.stats, *found.arguments, fault,
        _flags(grid, checks, "dkdv", q.device),
        qk_scale, scale, checks.tol, checks.near_inf,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk_heads.stride(),
        *dv_heads.stride(), heads, group, n_q, n_k, dim, rows,
        **_constants("dkdv", tiles, width, causal, checks, found, inject, q),
    )
    # fmt: on
    if group > 1:
        dk.copy_(dk_heads.view(batch, kv_heads, group, n_k, dim).sum(2))
        dv.copy_(dv_heads.view(batch, kv_heads, group, n_k, dim).sum(2))
    tiles = blocks("dq", width, q.dtype, q.device)
    # K's row sums check dQ; their largest row norm, with V's, bounds sum P = 1 and sum dS = 0
    identities = checks.has(kernels.BWD_SCORES, kernels.GRAD_PROBS)
    _, kr, vr = _key_value_sums(
        k, v, tiles.block_n, width, False, identities or checks.has(kernels.GRAD_Q),
        checks.has(kernels.GRAD_PROBS),
    )  # fmt: skip
    # fmt: off
    grid = (triton.cdiv(n_q, tiles.block_m), batch * heads)
    _twice(
        module._bwd_dq_kernel, grid,
        q, k, v, do, lse, delta, odo, dq, *kr, vr[1], *found.arguments, fault,
        _flags(grid, checks, "dq", q.device),
        qk_scale, scale, checks.tol, unit_roundoff(o.dtype), checks.near_inf,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(),
        heads, heads // kv_heads, n_q, n_k, dim, rows,
        **_constants("dq", tiles, width, causal, checks, found, inject, q),
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
    if args[0].device.type == "cuda" and constants["TMA"]:
        _scratch_allocator()
    kernel[grid](*args, RETRY=False, **constants)
    if constants["DUE"] != 0:
        kernel[grid](*args, RETRY=True, **constants)


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
    return torch.cuda.get_device_capability(device)[0] >= 9


def tma_ready(x: Tensor) -> Tensor:
    """``x`` [batch, heads, seq, dim] as TMA descriptors take it: its last dim contiguous, its
    base and other strides multiples of 16 bytes; a copy (the last dim padded) where it is not.
    Megatron's layouts need none."""
    unit = 16 // x.element_size()
    if (
        x.stride(-1) == 1
        and x.data_ptr() % 16 == 0
        and all(stride % unit == 0 for stride in x.stride()[:-1])
    ):
        return x
    padded = -(-x.shape[-1] // unit) * unit
    copy = x.new_zeros(*x.shape[:-1], padded)
    copy[..., : x.shape[-1]] = x
    return copy[..., : x.shape[-1]]


def _key_value_sums(
    k: Tensor, v: Tensor, block: int, width: int, columns: bool, k_rows: bool, v_rows: bool
) -> tuple[tuple[Tensor, Tensor], ...]:
    """K's column and row sums and V's row sums (checksums.key_value_sums) as kernel arguments,
    parts and stats, placeholders for a kind not asked for."""
    made = checksums.key_value_sums(k, v, block, width, columns, k_rows, v_rows)
    placeholder = torch.empty(0, dtype=k.dtype, device=k.device)
    return tuple((s.parts, s.stats) if s else (placeholder, placeholder) for s in made)


def _constants(
    kernel: str,
    tiles: Blocks,
    width: int,
    causal: bool,
    checks: Checks,
    found: Findings,
    inject: Tensor | None,
    q: Tensor,
) -> dict:
    """A launch's constexprs and launch options."""
    return {
        "BLOCK_M": tiles.block_m,
        "BLOCK_N": tiles.block_n,
        "HEAD_DIM": width,
        "CAUSAL": causal,
        "DUE": checks.due & sum(1 << int(s) for s in KERNEL_SECTIONS[kernel]),
        "SCALED": checksums.HEADROOM.get(q.dtype, 0) != 0,
        "INJECT": inject is not None,
        "CALIBRATE": found.ratio is not None,
        "TMA": tma(q.device),
        "num_warps": tiles.num_warps,
        "num_stages": tiles.num_stages,
        **({"maxnreg": tiles.maxnreg} if tiles.maxnreg else {}),
    }


def _fault(inject: Tensor | None, device: torch.device) -> Tensor:
    """The kernels' INJ argument: the armed fault, or a placeholder (INJECT off)."""
    return inject if inject is not None else torch.empty(0, dtype=torch.int32, device=device)


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the distance from 1 to the next number of ``dtype``."""
    return torch.finfo(dtype).eps / 2
