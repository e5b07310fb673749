"""The checked GEMM's static gate (megatron_abft.ops.checked_gemm): its sm_90 builds, made as
``checked_linear`` launches them (Triton's own binder specialises the arguments), and what
ptxas and the SASS of the main loop say. tests/ops/test_checked_gemm_gate.py holds every build to
``problems``; ``python -m tools.checked_gemm_sass`` prints the table.

The checks' work is CUDA-core instructions beside the loop's wgmma: the kernel keeps the MMA's
pace only while the loop issues in fewer cycles than its MMAs take, and while that work sits
between the wgmma's issue and the wait for them (``in_flight``). Both are counted here, not
timed: the instructions a warp issues an iteration times the warps over the SM's four
schedulers, against the tile's multiply-adds at Hopper's dense 16-bit tensor rate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from megatron_abft.check.ledger import EVENT_FIELDS, Ledger
from megatron_abft.dev import aot, sass
from megatron_abft.ops import checked_gemm
from megatron_abft.ops.checked_gemm import Tiles

MMA_FLOPS_PER_CYCLE = 4096
"""Dense bf16/fp16 tensor-core FLOPs a cycle an SM on Hopper (H100 SXM: 989 TFLOP/s over 132
SMs at 1.83 GHz)."""
SCHEDULERS = 4
"""Warp schedulers an SM, each issuing one instruction a cycle."""
SHAPE = (16384, 3072, 1024)
"""(m, n, k) built: GPT-3 350M's QKV projection at micro-batch 8 (only divisibility matters)."""


@dataclass(frozen=True)
class GemmBuild:
    """One launch of the checked GEMM built for sm_90."""

    check: bool
    dtype: str
    bias: bool
    tile: Tiles
    registers: int
    stack: int
    spills: int
    warnings: tuple[str, ...]
    shared: int
    ctas_per_sm: int
    loop_instructions: int
    """Instructions a warp issues in one iteration of the main loop."""
    mma: tuple[tuple[str, int], ...]
    """The main loop's MMA instructions, by opcode."""
    in_flight: int = 0
    """Of ``loop_instructions``, those issued between the loop's first wgmma and its wait for
    them (WARPGROUP.DEPBAR): work that overlaps the tensor cores'."""
    launch: str = "linear"
    """What the launch computes: ``linear`` (checked_linear), or the attention's ``scores``
    or ``context`` at head dim 64 or 128 (checked_matmul), e.g. ``scores hd64``."""

    @property
    def issue_cycles(self) -> float:
        """Cycles the SM's schedulers take to issue one iteration of every warp."""
        return self.loop_instructions * self.tile.num_warps / SCHEDULERS

    @property
    def mma_cycles(self) -> float:
        """Cycles the tensor cores take for one iteration's multiply-adds."""
        t = self.tile
        return 2 * t.block_m * t.block_n * t.block_k / MMA_FLOPS_PER_CYCLE

    @property
    def problems(self) -> list[str]:
        """What fails the gate: a spill, a serialised wgmma (C7515), a main-loop MMA that is not
        wgmma, a loop that issues slower than its MMAs run."""
        found = []
        if self.stack or self.spills:
            found.append(f"spills: stack {self.stack} B, spill stores {self.spills} B")
        if "C7515" in self.warnings:
            found.append("ptxas serialises the wgmma (C7515)")
        if not self.mma or any(not op.startswith("HGMMA") for op, _ in self.mma):
            found.append(f"main-loop MMAs not all wgmma: {dict(self.mma)}")
        if self.issue_cycles > self.mma_cycles:
            found.append(
                f"the loop issues in {self.issue_cycles:.0f} cycles, its MMAs take "
                f"{self.mma_cycles:.0f}"
            )
        return found


def build(check: bool, dtype: str = "bfloat16", bias: bool = True) -> GemmBuild:
    """The sm_90 build of one launch of checked_linear on GPU tensors of ``dtype``, laid out as
    Megatron's linear layers hold them (activations and weight row-major)."""
    return _summary(_gemm(check, dtype, bias, 90), check, dtype, bias, "linear")


def attention_build(gemm: str, check: bool, dtype: str, head_dim: int) -> GemmBuild:
    """The sm_90 build of checked_matmul's launch for the unfused attention's ``gemm``
    (``scores``: softmax scale * Q K^T; ``context``: P V) on ``dtype`` at ``head_dim``, its
    operands laid out as the protected attention passes them (Q, K and V as Megatron's
    ``[s, b, heads, head_dim]``, the scores contiguous, the context written as ``[s, b, heads,
    head_dim]``)."""
    b, heads, s = ATTENTION
    torch_dtype = getattr(torch, dtype)
    tile = checked_gemm.tiles_for(torch.device("cuda"), check)

    def seq_major(*shape) -> torch.Tensor:  # [s, b, heads, d] as [b, heads, s, d]
        return torch.empty(*shape, dtype=torch_dtype).permute(1, 2, 0, 3)

    if gemm == "scores":
        x, w = seq_major(s, b, heads, head_dim), seq_major(s, b, heads, head_dim)
        y, alpha = torch.empty(b, heads, s, s, dtype=torch_dtype), head_dim**-0.5
    else:
        x = torch.empty(b, heads, s, s, dtype=torch_dtype)
        w, y, alpha = seq_major(s, b, heads, head_dim).mT, seq_major(s, b, heads, head_dim), 1.0
    n, k = w.shape[2:]
    sums = torch.empty(b, heads, triton.cdiv(n, tile.block_n), 2, k) if check else None
    programs = checked_gemm._programs(s, n, tile) if check else 0
    codes = torch.empty(b, heads, programs, dtype=torch.int32)
    args, options = checked_gemm.arguments(
        x, w, None, y, sums, codes, None, tile, 1.0, 1e10, check, alpha
    )
    compiled = _compiled(checked_gemm._checked_gemm_kernel, args, options)
    return _summary(compiled, check, dtype, False, f"{gemm} hd{head_dim}", tile)


ATTENTION = (2, 4, 256)
"""(batch, heads, sequence) of the attention's builds (only divisibility matters)."""


def _summary(
    compiled, check: bool, dtype: str, bias: bool, launch: str, tile: Tiles | None = None
) -> GemmBuild:
    """What ptxas and the main loop's SASS say of one ``compiled`` launch."""
    tile = tile or checked_gemm.GPU_TILES[check]
    registers, stack, spills, warnings = aot.ptxas_report(compiled.asm["ptx"], 90)
    loop = sass.main_loop(aot.disassemble(compiled))
    shared = compiled.metadata.shared
    return GemmBuild(
        check,
        dtype,
        bias,
        tile,
        registers,
        stack,
        spills,
        warnings,
        shared,
        sass.ctas_per_sm(registers, shared, tile.num_warps, 90),
        len(loop.body) if loop else 0,
        tuple(sorted(loop.mma.items())) if loop else (),
        in_flight(loop.body) if loop else 0,
        launch,
    )


def in_flight(body: list[sass.Instruction]) -> int:
    """Instructions of a loop ``body`` after its first wgmma and before its first wait on them,
    the wgmma themselves not counted (0 where it has no such window)."""
    issued = [i for i, x in enumerate(body) if x.base == "HGMMA"]
    waits = [i for i, x in enumerate(body) if x.opcode.startswith("WARPGROUP.DEPBAR")]
    if not issued or not waits or waits[0] < issued[0]:
        return 0
    window = body[issued[0] : waits[0]]
    return sum(1 for x in window if x.base != "HGMMA")


def _gemm(check: bool, dtype: str, bias: bool, arch: int):
    """One launch of checked_linear (SHAPE, ``dtype``, with a bias or not) built for
    ``sm_<arch>``."""
    m, n, k = SHAPE
    torch_dtype = getattr(torch, dtype)
    tile = checked_gemm.GPU_TILES[check]
    x, y = torch.empty(m, k, dtype=torch_dtype), torch.empty(m, n, dtype=torch_dtype)
    weight = torch.empty(n, k, dtype=torch_dtype)
    sums = torch.empty(triton.cdiv(n, tile.block_n), 2, k) if check else None
    codes = torch.empty(
        triton.cdiv(m, tile.block_m) * triton.cdiv(n, tile.block_n) if check else 0,
        dtype=torch.int32,
    )
    b = torch.empty(n, dtype=torch_dtype) if bias else None
    args, options = checked_gemm.arguments(
        x[None, None], weight[None, None], b, y[None, None], sums, codes, None, tile, 1.0, 1e10,
        check,
    )  # fmt: skip
    return _compiled(checked_gemm._checked_gemm_kernel, args, options, arch)


def a100_builds() -> list[tuple[bool, str, int, int]]:
    """The sm_80 (A100) builds of checked_linear's launches, bf16 and fp16, checked and not:
    (check, dtype, registers, bytes spilled). Hopper's tiles on mma.sync, through masked
    pointers as there; no budget but no spill."""
    made = []
    for dtype in ("bfloat16", "float16"):
        for check in (True, False):
            registers, stack, spills, _ = aot.ptxas_report(
                _gemm(check, dtype, True, 80).asm["ptx"], 80
            )
            made.append((check, dtype, registers, stack + spills))
    return made


def _compiled(fn, args: tuple, options: dict, arch: int = 90):
    """``fn`` launched with ``args`` and ``options``, built for ``sm_<arch>`` as Triton's
    launcher specialises it."""
    return aot.compile_made(aot.specialize(fn, args, options, arch), arch)


def helper_builds() -> dict[str, tuple[int, int, tuple[str, ...]]]:
    """The sm_90 builds of the checked GEMM's two helper launches, the weight sums
    (checked_gemm.weight_sums, bf16) and the tally of a call's tile codes into a ledger
    (checked_gemm.tally): registers, bytes spilled and ptxas's warnings of each."""
    m, n, k = SHAPE
    tile = checked_gemm.GPU_TILES[True]
    blocks = triton.cdiv(n, tile.block_n)
    codes = torch.empty(triton.cdiv(m, tile.block_m) * blocks, dtype=torch.int32)
    weight = torch.empty(n, k, dtype=torch.bfloat16)
    ledger = Ledger.on(torch.device("cpu"), step=0)
    launches = {
        "weight_sums": (
            checked_gemm._weight_sums_kernel,
            (weight, torch.empty(blocks, 2, k), n, k, 1, 0, 0, *weight.stride()),
            {"BLOCK_N": tile.block_n, "BLOCK_K": checked_gemm.SUMS_BLOCK_K, "num_warps": 4},
        ),
        "tally": (
            checked_gemm._tally_kernel,
            (
                codes,
                1,
                codes.numel(),
                blocks,
                tile.block_m,
                tile.block_n,
                ledger.counts,
                ledger.clock,
                ledger.log,
                ledger.logged,
                torch.empty((), dtype=torch.int8),
                ledger.capacity,
                len(EVENT_FIELDS),
            ),
            {
                "BLOCK_Z": checked_gemm.TALLY_BLOCK[0],
                "BLOCK_T": checked_gemm.TALLY_BLOCK[1],
                "num_warps": 4,
            },
        ),
    }
    made = {}
    for name, (fn, args, options) in launches.items():
        registers, stack, spills, warnings = aot.ptxas_report(
            _compiled(fn, args, options).asm["ptx"], 90
        )
        made[name] = (registers, stack + spills, warnings)
    return made


def builds() -> list[GemmBuild]:
    """Every launch the gate holds: bf16 and fp16, checked and not, checked_linear's with a bias
    and without."""
    return [
        build(check, dtype, bias)
        for dtype in ("bfloat16", "float16")
        for check in (True, False)
        for bias in (True, False)
    ]


def attention_builds() -> list[GemmBuild]:
    """checked_matmul's launches for the unfused attention: the scores and the context at head
    dims 64 and 128, bf16 and fp16, checked and not."""
    return [
        attention_build(gemm, check, dtype, head_dim)
        for gemm in ("scores", "context")
        for head_dim in (64, 128)
        for dtype in ("bfloat16", "float16")
        for check in (True, False)
    ]
