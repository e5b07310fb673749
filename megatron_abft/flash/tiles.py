"""The flash kernels' tile shapes and the static gate's budgets, by kernel, head width and
dtype: plain data, without Triton, which the launcher (megatron_abft.flash.launch), the gate
(megatron_abft.dev.aot) and the overhead model (megatron_abft.tuning.scaling) read."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
"""Input dtypes the kernels take; they accumulate in fp32 whatever the input."""
GPU_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)
"""Input dtypes the kernels take on GPUs. fp32 operands would take 3xTF32 MMAs to keep the
checks' fp32 bound, and no tile shape of those built without spilling registers when it was
tried: fp32 runs in the interpreter only, as FlashAttention takes no fp32."""
HEAD_DIMS: tuple[int, ...] = (64, 128)
"""Head widths the kernels are built for; a narrower head is padded to the next."""
KERNELS: tuple[str, ...] = ("forward", "dkdv", "dq")

WIDTH = 16
"""Columns of a checksum tile W (megatron_abft.flash.checksums): tl.dot's smallest N."""
ONES = 6
"""The column of a row-sum tile (checksums: K's and V's) that holds ones, so that an MMA taking
the tile also sums its other operand's rows (dQ's sum of dS~, the identity that checks dP)."""


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
    """What the static gate allows a production kernel on sm_90 (megatron_abft.dev.aot,
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
(megatron_abft.flash.launch.tuned) may replace them on a GPU."""
BUDGETS: dict[tuple[str, int], Budget] = {
    ("forward", 64): Budget(10, 2, registers=72),
    ("forward", 128): Budget(14, 2, registers=64),
    ("dkdv", 64): Budget(16, 4, registers=88),
    ("dkdv", 128): Budget(20, 4, registers=48),
    ("dq", 64): Budget(14, 3, registers=64),
    ("dq", 128): Budget(16, 3, registers=64),
}
"""The gate's budgets for TILES (sm_90, bf16 and fp16, causal or not). The forward's at head
dim 64: its causal checked build holds 234 registers, as before its exponent became one explicit
FMA, which took its unchecked twin from 173 to 167 (both on one CTA an SM). dK/dV's at head dim
64: its checked builds hold 247 to 255 registers against 163 to 171, one CTA an SM either way
(at 163 a thread the unchecked kernel's 8 warps take more than half the register file)."""


INTERPRETED = Blocks(64, 64, 4, 2)
"""fp32's tiles: it runs in the interpreter only (GPU_DTYPES), where larger tiles run faster."""


def blocks(kernel: str, head_dim: int, dtype: torch.dtype) -> Blocks:
    """The tile shape of ``kernel`` for a padded ``head_dim`` and input ``dtype`` (before any
    tuning file, launch.blocks)."""
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
