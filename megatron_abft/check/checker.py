"""Checkers: how a guard checks one GEMM signature, chosen once per signature.

Every check of a GEMM's output goes through a checker: ``run`` verifies and corrects the output
in place and tallies what it found into the guard's ledger; ``sides`` gives both sides'
references as the kernels take them, for a screen that runs where another kernel reads the
output (the fused softmax, the softmax of the scores, through ``Reader``).

- ``ReferenceChecker``: checksum.encode and eec.verify_and_correct, on any device and input. It
  validates its inputs and derives the ops' constant arguments (blocks, threshold terms,
  capacity) on every call, in Python: more host time than the ops take to dispatch.
- ``CompiledChecker``: the compiled ops called directly with those arguments, derived once:
  check_gemm (encode_pair, add_bias with a bias, verify_correct, as one call) unless the
  references are given, else verify_correct; their tallying forms (check_gemm_tally,
  verify_correct_tally) into the ledger where the check is sync-free. Its results are the
  reference's, bit for bit; a matrix its kernels could not settle, on a check that may read the
  host, goes to the reference.

All the choice depends on is the tensors' layouts and the settings (``signature``), so a guard
takes the reference on the first check of a signature, which says what is wrong with bad input,
then keeps ``choose``'s checker for the rest. The flash attention's checks run inside its own
kernels (runtime.guard.KernelGuard) and need none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from megatron_abft.check.checksum import Checksums, broadcast_shapes, encode
from megatron_abft.check.eec import (
    CLEAN,
    UNCORRECTABLE,
    EECResult,
    GemmOperands,
    verify_and_correct,
)
from megatron_abft.check.ledger import Ledger
from megatron_abft.check.sides import Check, KernelSides, kernel_sides, side_bounds
from megatron_abft.check.tolerance import cuda_matmul_switches, gemm_rounding
from megatron_abft.config import ABFTConfig
from megatron_abft.ops import compiled

LEFT_TO_REFERENCE = object()
"""CompiledChecker.settle's answer where only the reference gives the result: a matrix the
kernels could not settle (and put back as it was), on a check that may read the host."""


def signature(
    output: Tensor,
    operands: GemmOperands,
    refs: tuple[Checksums, Checksums] | None,
    config: ABFTConfig,
    sync_free: bool,
) -> tuple | None:
    """Everything the choice of a check's checker depends on but the tensors' values; None for
    inputs that are not tensors (the reference says what is wrong with them). The layouts come
    from the extension in one call where it is loaded and nothing traces the check: read apart,
    they are a dozen calls into torch, which with the caches cold from a training step's other
    work cost a check on the CPU tens of microseconds."""
    a, b = operands.a, operands.b
    if output is None or a is None or b is None:
        return None
    layouts = _layouts(output, a, b, operands.bias)
    if layouts is None:
        return None
    key: tuple[Any, ...] = (
        layouts,
        operands.alpha,
        config.block_size,
        config.threshold_scale,
        config.near_inf,
        sync_free,
        compiled._disabled,
        compiled._emulating,
    )
    for r in refs or ():
        key += (_layouts(r.sums, r.magnitude, r.bias_magnitude), r.block, r.length, r.inner)
    if output.is_cuda:
        key += cuda_matmul_switches()
    return key


def screen_key(output: Tensor, operands: GemmOperands, config: ABFTConfig) -> tuple | None:
    """What decides that a check takes the same CPU screen as an earlier one of the same
    signature (CompiledChecker.host_screen), in one call into the extension: the layouts and
    ``signature``'s settings (on a CPU, where that screen runs, the host reads results whatever
    ``sync_free`` says). None where it may not be asked: traced, or without the extension."""
    if torch.compiler.is_compiling() or not compiled.available():
        return None
    return (
        compiled.layouts(output, operands.a, operands.b, operands.bias),
        operands.alpha,
        config.block_size,
        config.threshold_scale,
        config.near_inf,
        compiled._emulating,
    )


def _layouts(*tensors: Tensor | None) -> tuple | None:
    """The tensors' layouts (None as a layout of its own), or None where one is not a tensor."""
    if not torch.compiler.is_compiling() and compiled.available():
        return compiled.layouts(*tensors)
    if not all(t is None or isinstance(t, Tensor) for t in tensors):
        return None
    return tuple(None if t is None else _layout(t) for t in tensors)


def _layout(t: Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype, t.device


class Checker(Protocol):
    """A guard's check of one GEMM signature."""

    def run(
        self,
        output: Tensor,
        operands: GemmOperands,
        refs: tuple[Checksums, Checksums] | None,
        ledger: Ledger,
    ) -> Tensor | None:
        """Verify and correct ``output = alpha * a @ b + bias`` in place, against ``refs`` where
        given, else against references encoded from ``operands``, and tally what was found into
        ``ledger``. Returns whether a matrix stayed uncorrectable (a device bool), or None where
        the check is known clean without a host synchronisation (every clean check, where the
        host may be read)."""
        ...

    def sides(self, output: Tensor, operands: GemmOperands) -> KernelSides | None:
        """Both sides' references of ``output``, encoded from ``operands``, as the kernels take
        them (sides.kernel_sides), for a screen run elsewhere; None where the kernels do not
        take them."""
        ...


@dataclass(frozen=True)
class ReferenceChecker:
    """checksum.encode, then eec.verify_and_correct: any device, any input."""

    config: ABFTConfig
    sync_free: bool

    def run(
        self,
        output: Tensor,
        operands: GemmOperands,
        refs: tuple[Checksums, Checksums] | None,
        ledger: Ledger,
    ) -> Tensor | None:
        col, row = refs or self._encode(operands)
        result = verify_and_correct(
            output,
            col,
            row,
            operands=operands,
            threshold_scale=self.config.threshold_scale,
            near_inf=self.config.near_inf,
            check_references=False,
            sync_free=self.sync_free,
            ledger=ledger,
        )
        if result.known_clean:
            return None
        return result.tallied if result.tallied is not None else ledger.tally(result)

    def sides(self, output: Tensor, operands: GemmOperands) -> KernelSides | None:
        col, row = self._encode(operands)
        rounding = gemm_rounding(output.dtype, output.device)
        check = Check(rounding, self.config.threshold_scale, self.config.near_inf, 0, None)
        return kernel_sides(output, {"col": col, "row": row}, check)

    def _encode(self, operands: GemmOperands) -> tuple[Checksums, Checksums]:
        a, b, alpha, bias = operands.a, operands.b, operands.alpha, operands.bias
        return encode(a, b, alpha=alpha, bias=bias, block=self.config.block_size)


@dataclass(frozen=True)
class CompiledChecker:
    """The compiled ops of one signature's check and their constant arguments."""

    block: int  # of the encoded references (with references given: unused)
    alpha: float
    bounds: tuple[list[float], list[float]]  # both sides' (sides.side_bounds)
    blocks: tuple[int, int]  # both sides'
    near_inf: float
    capacity: int
    reference: ReferenceChecker  # for what the kernels could not settle, on the host
    host_screen: bool
    """Whether a clean check may end at the CPU's screen alone (compiled.screen_passes): CPU
    tensors whose results the host reads, not emulating the CUDA kernels."""

    @property
    def sync_free(self) -> bool:
        return self.reference.sync_free

    @classmethod
    def make(
        cls,
        output: Tensor,
        operands: GemmOperands,
        refs: tuple[Checksums, Checksums] | None,
        reference: ReferenceChecker,
    ) -> CompiledChecker | None:
        """The compiled checker of a check of ``output`` that the reference has just taken with
        these arguments (which it validated); None where the compiled ops alone would not run
        it."""
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
        config = reference.config
        block = config.block_size
        if refs is None:  # encoded here: the shapes encode gives its Checksums
            if not compiled.encode_pair_applies(a, b):
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
            reference=reference,
            host_screen=(
                output.device.type == "cpu" and not reference.sync_free and not compiled._emulating
            ),
        )

    def sides(self, output: Tensor, operands: GemmOperands) -> KernelSides:
        with torch.no_grad():  # not a decorator: traced, a checker made in the trace calls it
            return self._sides(operands, None)

    def _sides(
        self, operands: GemmOperands, refs: tuple[Checksums, Checksums] | None
    ) -> KernelSides:
        if refs is None:
            ops, a, bias = torch.ops.megatron_abft, operands.a, operands.bias
            sums = ops.encode_pair.default(a, operands.b, self.alpha, self.block)
            if bias is not None:
                sums = ops.add_bias.default(*sums, bias, a.shape[-2], self.block)
            col, row = [sums[0], sums[1], *sums[4:5]], [sums[2], sums[3], *sums[5:6]]
        else:
            col, row = ([r.sums, r.magnitude, *_present(r.bias_magnitude)] for r in refs)
        return KernelSides(*self.blocks, col, row, *self.bounds)

    def run(
        self,
        output: Tensor,
        operands: GemmOperands,
        refs: tuple[Checksums, Checksums] | None,
        ledger: Ledger,
    ) -> Tensor | None:
        if refs is None and self.host_screen and self.screen(output, operands):
            return None  # a clean C ends at the screen: no tensor made
        failed = self.settle(output, operands, refs, ledger)
        if failed is LEFT_TO_REFERENCE:
            return self.reference.run(output, operands, refs, ledger)
        return failed

    def screen(self, output: Tensor, operands: GemmOperands) -> bool:
        """Whether ``output`` passes the CPU's screen (compiled.screen_passes), which ends a
        clean check where ``host_screen`` holds."""
        a, b, bias = operands.a, operands.b, operands.bias
        return compiled.screen_passes(
            output, a, b, self.alpha, bias, self.block, *self.bounds, self.capacity
        )

    def settle(
        self,
        output: Tensor,
        operands: GemmOperands,
        refs: tuple[Checksums, Checksums] | None,
        ledger: Ledger,
    ) -> Tensor | None | object:
        """``run`` by the kernels alone, past the CPU's screen: as ``run``, or LEFT_TO_REFERENCE
        where a matrix is left for the reference."""
        if refs is None:  # encoded, biased and verified in one call, outside autograd
            found = self._check(output, operands, ledger)
        else:
            with torch.no_grad():
                found = self._verify(output, operands, refs, ledger)
        if self.sync_free:
            return found[5]
        status = found[0]
        worst = int(status if status.dim() == 0 else status.max()) if status.numel() else CLEAN
        if worst == CLEAN:
            return None
        if worst == UNCORRECTABLE:
            return LEFT_TO_REFERENCE
        return ledger.tally(EECResult(*found))

    def _check(self, output: Tensor, operands: GemmOperands, ledger: Ledger) -> tuple:
        """check_gemm, or check_gemm_tally into ``ledger`` where the check is sync-free."""
        ops, a, b, bias = torch.ops.megatron_abft, operands.a, operands.b, operands.bias
        arguments = (output, a, b, self.alpha, bias, self.block, *self.bounds)
        arguments += (self.near_inf, self.capacity)
        if self.sync_free:
            return ops.check_gemm_tally.default(*arguments, *compiled._ledger_args(ledger))
        return ops.check_gemm.default(*arguments)

    def _verify(
        self,
        output: Tensor,
        operands: GemmOperands,
        refs: tuple[Checksums, Checksums],
        ledger: Ledger,
    ) -> tuple:
        """verify_correct against ``refs``, or verify_correct_tally into ``ledger`` where the
        check is sync-free."""
        ops, a, b, bias = torch.ops.megatron_abft, operands.a, operands.b, operands.bias
        arguments = (output, *self._sides(operands, refs), a, b, self.alpha, bias)
        arguments += (self.near_inf, self.capacity)
        if self.sync_free:
            return ops.verify_correct_tally.default(*arguments, *compiled._ledger_args(ledger))
        return ops.verify_correct.default(*arguments)


def choose(
    output: Tensor,
    operands: GemmOperands,
    refs: tuple[Checksums, Checksums] | None,
    config: ABFTConfig,
    sync_free: bool,
) -> Checker:
    """The checker for the signature of a check the reference has just taken with these
    arguments: the compiled one where its ops take them, else the reference."""
    reference = ReferenceChecker(config, sync_free)
    return CompiledChecker.make(output, operands, refs, reference) or reference


@dataclass(frozen=True)
class KernelCorrection:
    """What a kernel that screens a GEMM's output as it reads it needs to correct the output
    itself, with no host read: the GEMM's operands (a, b, alpha: output = alpha a @ b), the
    check's near-INF bound and vectors per side, and the ledger it tallies into."""

    operands: tuple[Tensor, Tensor, float]
    near_inf: float
    capacity: int
    ledger: Ledger


class Reader(Protocol):
    """A kernel that reads a GEMM's output and can screen it on the way (the fused softmax reads the
    scores), for SectionGuard.check_read: ``read`` by that kernel, ``plain`` without it."""

    def fuses(self, screen: bool) -> bool:
        """Whether ``read`` is to read the output: its kernel applies and has work to do (a
        ``screen``, or a pass of its own)."""
        ...

    def plain(self, output: Tensor) -> tuple[Tensor, Any]:
        """What is read from ``output``, checked already, without the kernel; None for what
        only the kernel gives."""
        ...

    def read(
        self, output: Tensor, sides: tuple, correction: KernelCorrection | None = None
    ) -> tuple[Tensor, Tensor, Any]:
        """What is read from ``output`` by the kernel, screened against ``sides`` (empty: no
        screen), and its finding: per matrix, the vectors that failed the screen, or with a
        ``correction``, whether a matrix stayed uncorrectable after the kernel corrected and
        tallied it."""
        ...


def _present(t: Tensor | None) -> tuple[Tensor, ...]:
    return () if t is None else (t,)
