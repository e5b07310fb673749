"""CheckPlan: a guard's check of one GEMM signature, validated once.

A check's general path (checksum.encode, then eec.verify_and_correct) validates its inputs,
decides which compiled ops apply and derives their constant arguments (blocks, threshold
terms, capacity) on every call, in Python: more host time than its ops take to dispatch. All of
that depends only on the tensors' layouts and the settings (``signature``), so a guard takes
the general path on the first check of a signature, which says what is wrong with bad input,
and plans the rest: the compiled ops called directly, encode_pair (and add_bias with a bias)
unless the references are given, then verify_correct, or verify_correct_tally into the guard's
ledger where the check is sync-free. Its results are the general path's, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from megatron_abft.check.checksum import Checksums, broadcast_shapes
from megatron_abft.check.eec import CLEAN, UNCORRECTABLE, EECResult, GemmOperands
from megatron_abft.check.ledger import Ledger
from megatron_abft.check.sides import Check, side_bounds
from megatron_abft.check.tolerance import cuda_matmul_switches, gemm_rounding
from megatron_abft.config import ABFTConfig
from megatron_abft.ops import compiled

GENERAL = object()
"""CheckPlan.run's answer where only the general path gives the result: a matrix the kernels
could not settle (and put back as it was), on a check that may read the host."""


def signature(
    output: Tensor,
    operands: GemmOperands,
    refs: tuple[Checksums, Checksums] | None,
    config: ABFTConfig,
    sync_free: bool,
) -> tuple | None:
    """Everything a check's plan depends on but the tensors' values; None for inputs that are
    not tensors (the general path says what is wrong with them)."""
    a, b, bias = operands.a, operands.b, operands.bias
    if not all(isinstance(t, Tensor) for t in (output, a, b)):
        return None
    key: tuple[Any, ...] = (
        _layout(output),
        _layout(a),
        _layout(b),
        None if bias is None else _layout(bias),
        operands.alpha,
        config.block_size,
        config.threshold_scale,
        config.near_inf,
        sync_free,
        compiled._disabled,
        compiled._emulating,
    )
    if refs is not None:
        key += tuple(
            (_layout(r.sums), _layout(r.magnitude), r.block, r.length, r.inner)
            + (None if r.bias_magnitude is None else _layout(r.bias_magnitude),)
            for r in refs
        )
    if output.device.type == "cuda":
        key += cuda_matmul_switches()
    return key


def _layout(t: Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype, t.device


@dataclass(frozen=True)
class CheckPlan:
    """The ops of one signature's check and their constant arguments."""

    block: int  # of the encoded references (with references given: unused)
    alpha: float
    bounds: tuple[list[float], list[float]]  # both sides' (sides.side_bounds)
    blocks: tuple[int, int]  # both sides'
    near_inf: float
    capacity: int
    sync_free: bool

    @classmethod
    def make(
        cls,
        output: Tensor,
        operands: GemmOperands,
        refs: tuple[Checksums, Checksums] | None,
        config: ABFTConfig,
        sync_free: bool,
    ) -> CheckPlan | None:
        """The plan of a check of ``output`` that the general path has just taken with these
        arguments (which it validated); None where it would not run the compiled ops alone."""
        a, b, alpha, bias = operands.a, operands.b, operands.alpha, operands.bias
        if output.dim() < 2 or output.numel() == 0 or not isinstance(alpha, int | float):
            return None
        if (output.shape[-2], output.shape[-1]) != (a.shape[-2], b.shape[-1]):
            return None
        try:  # the operands' batch broadcasts to the output's
            batch = broadcast_shapes(a.shape[:-2], b.shape[:-2], output.shape[:-2])
        except RuntimeError:
            return None
        if batch != output.shape[:-2]:
            return None
        if not compiled.verify_correct_applies(output, a, b, bias):
            return None
        natural = torch.float64 if output.dtype == torch.float64 else torch.float32
        m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
        block = config.block_size
        if refs is None:  # encoded here: the shapes encode gives its Checksums
            if not compiled.encode_pair_applies(a, b, block):
                return None
            if bias is not None and not compiled.add_bias_applies(bias):
                return None
            if (a.dtype == torch.float64) != (natural == torch.float64):
                return None  # the references would not be in the output's accumulation dtype
            shapes = ((block, m, k), (block, n, k))
        else:
            tensors = [t for r in refs for t in (r.sums, r.magnitude, r.bias_magnitude)]
            if any(t is not None and t.dtype != natural for t in tensors):
                return None
            shapes = tuple((r.block, r.length, r.inner) for r in refs)
        check = Check(
            gemm_rounding(output.dtype, output.device), config.threshold_scale, 0, 0, None
        )
        return cls(
            block=block,
            alpha=float(alpha),
            bounds=tuple(side_bounds(check, *shape) for shape in shapes),
            blocks=tuple(shape[0] for shape in shapes),
            near_inf=config.near_inf,
            capacity=max(output.shape[-2:]),
            sync_free=sync_free,
        )

    @torch.no_grad()
    def sides(self, operands: GemmOperands, refs: tuple[Checksums, Checksums] | None) -> tuple:
        """Both sides of the check as the kernels take them (sides.kernel_sides): ``refs``, or
        the references encoded from ``operands``."""
        return self._sides(operands, refs)

    def _sides(self, operands: GemmOperands, refs: tuple[Checksums, Checksums] | None) -> tuple:
        if refs is None:
            ops, a, bias = torch.ops.megatron_abft, operands.a, operands.bias
            sums = ops.encode_pair.default(a, operands.b, self.alpha, self.block)
            if bias is not None:
                sums = ops.add_bias.default(*sums, bias, a.shape[-2], self.block)
            col, row = [sums[0], sums[1], *sums[4:5]], [sums[2], sums[3], *sums[5:6]]
        else:
            col, row = ([r.sums, r.magnitude, *_present(r.bias_magnitude)] for r in refs)
        return (*self.blocks, col, row, *self.bounds)

    @torch.no_grad()
    def run(
        self,
        output: Tensor,
        operands: GemmOperands,
        refs: tuple[Checksums, Checksums] | None,
        ledger: Ledger,
    ) -> Tensor | None | object:
        """Verify and correct ``output`` in place and tally what was found into ``ledger``, as
        SectionGuard's general path does: whether a matrix stayed uncorrectable (a device bool),
        None where the check read that it was clean, or GENERAL."""
        ops = torch.ops.megatron_abft
        a, b, bias = operands.a, operands.b, operands.bias
        sides = self._sides(operands, refs)
        if self.sync_free:
            found = ops.verify_correct_tally.default(
                output, *sides, a, b, self.alpha, bias, self.near_inf, self.capacity,
                *compiled._ledger_args(ledger),
            )  # fmt: skip
            return found[5]
        found = ops.verify_correct.default(
            output, *sides, a, b, self.alpha, bias, self.near_inf, self.capacity
        )
        worst = int(found[0].max()) if found[0].numel() else CLEAN
        if worst == CLEAN:
            return None
        if worst == UNCORRECTABLE:
            return GENERAL
        return ledger.tally(EECResult(*found))


def _present(t: Tensor | None) -> tuple[Tensor, ...]:
    return () if t is None else (t,)
