"""Launching the flash kernels: block sizes, grids, and the choice between Triton's compiler (CUDA
tensors) and its interpreter (CPU tensors, the same source) with nothing for the user to set.

The interpreter is a second load of megatron_abft.flash.kernels with Triton's interpret switch
on while it is decorated: ``triton.jit`` picks compiled or interpreted functions at decoration
time, and a kernel's helpers resolve through its module, so each build needs its own module.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import os
import sys
from dataclasses import dataclass
from types import ModuleType

import torch
import triton
from torch import Tensor

from megatron_abft.flash import checksums, kernels

DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
"""Input dtypes the kernels take; they accumulate in fp32 whatever the input."""
GPU_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)
"""Input dtypes the kernels take on GPUs. fp32 operands would take 3xTF32 MMAs to keep the
checks' fp32 bound, and no tile shape of those builds without spilling registers (measured by
tools/flash_aot.py): fp32 runs in the interpreter only, as FlashAttention takes no fp32."""
HEAD_DIMS: tuple[int, ...] = (64, 128)
"""Head widths the kernels are built for; a narrower head is padded to the next."""
KERNELS: tuple[str, ...] = ("forward", "dkdv", "dq")

TILE_C = 64.0
"""The tile checks' bound is ``TILE_C * threshold_scale * 2**-24 * mass`` (docs/abft.md §8):
tools/flash_false_alarms.py measures each check's largest clean residual against it, on the
CPU and, with ``--device cuda``, on a GPU's tensor cores."""


@dataclass(frozen=True)
class Blocks:
    """The tile shape and launch options of one kernel."""

    block_m: int
    """Query rows a tile."""
    block_n: int
    """Key rows a tile."""
    num_warps: int
    num_stages: int


TILES: dict[tuple[str, int], Blocks] = {
    ("forward", 64): Blocks(128, 64, 8, 2),
    ("forward", 128): Blocks(32, 32, 8, 2),
    ("dkdv", 64): Blocks(32, 32, 8, 2),
    ("dkdv", 128): Blocks(32, 32, 8, 2),
    ("dq", 64): Blocks(64, 16, 8, 2),
    ("dq", 128): Blocks(32, 32, 4, 2),
}
"""Tile shapes by kernel and head width, for bf16 and fp16 (the same for both): the first of
tools/flash_aot.py's candidates, largest first, whose every variant builds for sm_80 and sm_90
without spilling (``python tools/flash_aot.py --search``). For dK/dV, block_m is the query
block it streams and block_n the key block it holds."""
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


# --- compiled or interpreted -----------------------------------------------------------------


def _patch_interpreter(interpreter: ModuleType) -> None:
    """Two fixes to Triton 3.6's interpreter for kernels interpreted in a process that also
    compiles, applied within each interpreted launch (its own patch scope, undone after):

    - triton.language's library functions (tl.sum, tl.max, tl.cdiv...) were decorated for the
      compiler when triton was imported: they run as interpreted functions instead;
    - its tensors serve as ``range`` bounds under numpy >= 2.4, which refuses ``int()`` of a
      one-element array (triton-lang/triton#9171): every scalar in the interpreter is one.
    """
    original = interpreter._patch_lang_tensor
    if getattr(original, "abft_fixes", False):
        return
    import triton.experimental.gluon  # noqa: F401  imported on the first launch: before the patch
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    library = [
        (module, name, member)
        for module in (tl, tl.standard)
        for name, member in vars(module).items()
        if isinstance(member, JITFunction)
    ]
    interpreted = {
        id(member): interpreter.InterpretedFunction(member.fn) for _, _, member in library
    }

    def patch(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
        for module, name, member in library:
            scope.set_attr(module, name, interpreted[id(member)])

    patch.abft_fixes = True
    interpreter._patch_lang_tensor = patch


@contextlib.contextmanager
def _interpreting():
    """Triton's interpret switch on, and its environment variable as it was after."""
    before = os.environ.get("TRITON_INTERPRET")
    triton.knobs.runtime.interpret = True
    try:
        yield
    finally:
        del triton.knobs.runtime.interpret
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before


@functools.cache
def interpreted_kernels() -> ModuleType:
    """megatron_abft.flash.kernels loaded again, its kernels decorated for the interpreter."""
    from triton.runtime import interpreter

    _patch_interpreter(interpreter)
    name = kernels.__name__ + "_interpreted"
    spec = importlib.util.spec_from_file_location(name, kernels.__file__)
    module = importlib.util.module_from_spec(spec)
    with _interpreting():
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module


def kernels_for(device: torch.device) -> ModuleType:
    """The kernels that run on ``device``: compiled on CUDA, interpreted on CPU."""
    if device.type == "cuda":
        return kernels
    if device.type == "cpu":
        return interpreted_kernels()
    raise ValueError(f"flash attention runs on CUDA or CPU tensors, not {device.type}")


# --- launches --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Checks:
    """What a launch checks and how strictly."""

    due: int
    """Bit i set: section FLASH_SECTIONS[i] is checked on this call."""
    tol: float
    """``c * 2**-24``: the tile checks' bound per unit of mass."""
    near_inf: float
    """Residuals above this count as near-INF faults."""

    @property
    def compiled(self) -> bool:
        return self.due != 0


@dataclass
class Found:
    """What one launch's checks found, one entry a section and (batch, head) matrix, on the
    device: ``codes`` as kernels.py describes, the first flagged row and column (int32 max:
    none), and, in calibration runs, the largest clean residual ratio."""

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
        shape = (len(kernels_sections()), matrices)
        return cls(
            torch.zeros(shape, dtype=torch.int32, device=device),
            torch.full(shape, kernels.NO_ROW.value, dtype=torch.int32, device=device),
            torch.full(shape, kernels.NO_ROW.value, dtype=torch.int32, device=device),
            torch.zeros(shape, dtype=torch.float32, device=device) if calibrate else None,
        )


def kernels_sections() -> range:
    return range(kernels.N_SECTIONS.value)


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
    sums = _sums(checks, tiles.block_n, width, (checksums.columns, k), (checksums.rows, v))
    # fmt: off
    kernels_for(q.device)._fwd_kernel[(triton.cdiv(n_q, tiles.block_m), batch * heads)](
        q, k, v, o, lse, *sums, *found.arguments, _fault(inject, q.device),
        scale * math.log2(math.e), checks.tol, checks.near_inf, checks.due,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        heads, heads // kv_heads, n_q, n_k, dim,
        **_constants(tiles, width, causal, checks, found, inject, q),
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
    o32, do32 = o.float(), do.float()
    delta = (o32 * do32).sum(-1)
    odo = (o32.abs() * do32.abs()).sum(-1) if checks.compiled else delta
    del o32, do32
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    module = kernels_for(q.device)
    fault = _fault(inject, q.device)
    qk_scale = scale * math.log2(math.e)
    tiles = blocks("dkdv", width, q.dtype)
    sums = _sums(
        checks,
        tiles.block_m,
        width,
        (checksums.columns, q),
        (checksums.rows, q),
        (checksums.columns, do),
        (checksums.rows, do),
    )
    # fmt: off
    module._bwd_dkdv_kernel[(triton.cdiv(n_k, tiles.block_n), batch * kv_heads)](
        q, k, v, do, lse, delta, dk, dv, *sums, *found.arguments, fault,
        qk_scale, scale, checks.tol, checks.near_inf, checks.due,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(),
        heads, heads // kv_heads, n_q, n_k, dim,
        **_constants(tiles, width, causal, checks, found, inject, q),
    )
    # fmt: on
    tiles = blocks("dq", width, q.dtype)
    sums = _sums(
        checks,
        tiles.block_n,
        width,
        (checksums.columns, k),
        (checksums.rows, k),
        (checksums.columns, v),
    )
    # fmt: off
    module._bwd_dq_kernel[(triton.cdiv(n_q, tiles.block_m), batch * heads)](
        q, k, v, do, lse, delta, odo, dq, *sums, *found.arguments, fault,
        qk_scale, scale, checks.tol, unit_roundoff(o.dtype), checks.near_inf, checks.due,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(),
        heads, heads // kv_heads, n_q, n_k, dim,
        **_constants(tiles, width, causal, checks, found, inject, q),
    )
    # fmt: on
    return dq, dk, dv


def _constants(
    tiles: Blocks,
    width: int,
    causal: bool,
    checks: Checks,
    found: Found,
    inject: Tensor | None,
    q: Tensor,
) -> dict:
    """A launch's constexprs and launch options."""
    return {
        "BLOCK_M": tiles.block_m,
        "BLOCK_N": tiles.block_n,
        "HEAD_DIM": width,
        "CAUSAL": causal,
        "CHECK": checks.compiled,
        "INJECT": inject is not None,
        "CALIBRATE": found.ratio is not None,
        # the interpreter's bf16 tl.dot multiplies bit patterns (triton-lang/triton#11584)
        "UPCAST": q.device.type != "cuda" and q.dtype == torch.bfloat16,
        "num_warps": tiles.num_warps,
        "num_stages": tiles.num_stages,
    }


def _fault(inject: Tensor | None, device: torch.device) -> Tensor:
    """The kernels' INJ argument: the armed fault, or a placeholder (INJECT off)."""
    return inject if inject is not None else torch.zeros(9, dtype=torch.int32, device=device)


def _sums(checks: Checks, block: int, width: int, *wanted) -> list[Tensor]:
    """The checksum vectors (checksums.py) of each ``(kind, tensor)`` in ``wanted``, tiled by
    ``block`` rows and padded to ``width``, as kernel arguments (parts, stats); placeholders
    where the checks are compiled out."""
    if not checks.compiled:
        return [torch.zeros(1, dtype=torch.int32, device=wanted[0][1].device)] * 2 * len(wanted)
    arguments = []
    for kind, x in wanted:
        sums = kind(x, block, width)
        arguments += [sums.parts, sums.stats]
    return arguments


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the distance from 1 to the next number of ``dtype``."""
    return torch.finfo(dtype).eps / 2
