"""The compiled checksum kernels (csrc/, built by setup.py as ``megatron_abft._C``), or the
reason the PyTorch path is in use.

The extension is imported on first use, so ``import megatron_abft`` works without it.
``block_sums``, ``row_products``, ``encode_pair``, ``add_bias``, ``screen``, ``verify_correct``,
``tally``, ``softmax_check`` and ``pair_vectors`` return None wherever the kernels do not apply
(no extension, a device without a kernel, meta tensors); callers then take their PyTorch path,
which stays the reference. ``emulated_cuda()`` runs the CUDA kernels on the CPU, for tests,
through the test-only extension ``megatron_abft._emulator``.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Protocol

import torch
from torch import Tensor


class Ledger(Protocol):
    """The device tensors a tally writes (megatron_abft.check.ledger.Ledger)."""

    counts: Tensor
    clock: Tensor
    log: Tensor
    logged: Tensor


_KERNEL_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_MAX_DIMS = 10  # [*batch, m, n] with at most 8 batch dims (csrc/kernels/abft.h)
_disabled = False
_emulating = False


_loaded: tuple[ModuleType | None, str] | None = None


def _load() -> tuple[ModuleType | None, str]:
    """The extension module (its import registers torch.ops.megatron_abft), or None and why.
    Kept in a global, not a functools.cache, which torch.compile traces through."""
    global _loaded
    if _loaded is None:
        _loaded = _import()
    return _loaded


def _import() -> tuple[ModuleType | None, str]:
    try:
        from megatron_abft import _C
    except ImportError as error:
        return None, (
            f"megatron_abft._C is not built ({error}); build it with "
            "`pip install --no-build-isolation --no-deps -e .` (ABFT_BUILD=auto|cuda|cpu)"
        )
    _register_fake()
    return _C, ""


@functools.cache
def _load_emulator() -> tuple[ModuleType | None, str]:
    """The test-only extension that holds the CUDA kernels built for the CPU and their bindings
    (imported by emulated_cuda alone), or None and why."""
    module, reason = _load()  # its ops, which the emulator's kernels register over
    if module is None:
        return None, reason
    try:
        from megatron_abft import _emulator
    except ImportError as error:
        return None, (
            f"megatron_abft._emulator is not built ({error}): setup.py builds it on x86-64 Linux "
            "unless ABFT_EMULATOR=0"
        )
    return _emulator, ""


def screen_passes(
    c: Tensor,
    a: Tensor,
    b: Tensor,
    alpha: float,
    bias: Tensor | None,
    block: int,
    col_bounds: list[float],
    row_bounds: list[float],
    capacity: int,
) -> bool:
    """Whether check_gemm's CPU screen takes the check of ``c = alpha * a @ b + bias`` and ``c``
    passes it (``_C.screen_passes``): check_gemm's finding for a clean ``c``, in one call that
    makes no tensor. False: the check is check_gemm's. For CPU tensors whose check results the
    host reads; never traced."""
    module = _load()[0]
    return module.screen_passes(c, a, b, alpha, bias, block, col_bounds, row_bounds, capacity)


def layouts(*tensors: Tensor | None) -> tuple | None:
    """The layouts of ``tensors`` (shapes, strides, dtypes, devices) as one tuple of ints, for a
    check's signature, in one call (``_C.layouts``; None counts as a layout of its own); None
    where an argument is not a tensor. Needs the extension (``available``)."""
    return _load()[0].layouts(*tensors)


def emulator_available() -> bool:
    """Whether emulated_cuda() can run: the test-only emulator extension is built."""
    return _load_emulator()[0] is not None


def available() -> bool:
    """Whether the compiled kernels are loaded (and not disabled)."""
    return not _disabled and _load()[0] is not None


def backend() -> str:
    """Where checksum sums run: ``"cuda"`` (CUDA kernels and a GPU), ``"cpu"`` (the C++ kernels:
    no GPU, or an extension built without CUDA, whose CUDA tensors take the PyTorch path) or
    ``"torch (<reason>)"``."""
    module, reason = _load()
    if _disabled:
        return "torch (the extension is disabled by megatron_abft.ops.compiled.disabled())"
    if module is None:
        return f"torch ({reason})"
    if _emulating:
        return "cuda (emulated on the CPU by megatron_abft.ops.compiled.emulated_cuda())"
    return "cuda" if module.cuda and torch.cuda.is_available() else "cpu"


@contextmanager
def disabled() -> Iterator[None]:
    """Run the PyTorch reference path inside this block (tests and benchmarks compare both)."""
    global _disabled
    previous, _disabled = _disabled, True
    try:
        yield
    finally:
        _disabled = previous


@contextmanager
def emulated_cuda(schedule: int = 0) -> Iterator[None]:
    """Inside this block the ops on CPU tensors run the CUDA kernels' source
    (csrc/kernels/abft_cuda.cu), built for the CPU through the CUDA emulator
    (csrc/emulator/cuda_emulator.h), instead of the C++ kernels: a test of the CUDA code on machines
    without a GPU, and slow. The emulator runs each GPU thread as a fiber, a block warp by warp, and
    raises on a divergent barrier or shuffle. ``schedule`` orders the warps, the lanes of a warp and
    the blocks: 0 in order, 1 reversed, any other value a random order from that seed; results that
    depend on it show a race. Built on x86-64 Linux (docs/abft.md section 7)."""
    global _emulating
    emulator, reason = _load_emulator()
    if emulator is None:
        raise RuntimeError(f"megatron_abft.ops.compiled.emulated_cuda: no CUDA emulator ({reason})")
    before = emulator.emulate(True, schedule)
    previous, _emulating = _emulating, True
    try:
        yield
    finally:
        emulator.emulate(*before)
        _emulating = previous


def emulated_launches() -> list[str]:
    """The kernels the emulator launched since the last call, in order, each as its launch
    names it in cuda_softmax.cuh (``softmax_rows_kernel<T>``): which of a launcher's kernels ran,
    for tests."""
    emulator, reason = _load_emulator()
    if emulator is None:
        raise RuntimeError(
            f"megatron_abft.ops.compiled.emulated_launches: no CUDA emulator ({reason})"
        )
    return emulator.launches()


def _serves(c: Tensor) -> bool:
    if c.dtype not in _KERNEL_DTYPES or not 2 <= c.dim() <= _MAX_DIMS:
        return False
    return _serves_device(c.device)


def _serves_device(device: torch.device) -> bool:
    if not available():
        return False
    if device.type == "cuda":
        return bool(_load()[0].cuda) and trusted(device)
    return device.type == "cpu"


_trusted: dict[torch.device, bool] = {}
_selftest: Callable[[torch.device], list[str]] | None = None


def register_selftest(mismatches: Callable[[torch.device], list[str]]) -> None:
    """Set the known-answer test ``trusted`` runs on a device before its kernels serve it (what
    the kernels get wrong there; megatron_abft.ops.selftest registers itself on import)."""
    global _selftest
    _selftest = mismatches


def trusted(device: torch.device) -> bool:
    """Whether the kernels passed the known-answer test on ``device`` (run on first use, once
    per device). A device whose kernels disagree with the PyTorch path keeps that path, with a
    warning that names what disagreed."""
    if device not in _trusted:
        if _selftest is None:
            raise RuntimeError(
                "no known-answer test of the kernels is registered: import "
                "megatron_abft.ops.selftest (importing megatron_abft does)"
            )
        _trusted[device] = True  # while the test runs, its own calls reach the kernels
        try:
            wrong = _selftest(device)
        except BaseException:
            del _trusted[device]  # not tested: the next call tries again
            raise
        _trusted[device] = not wrong
        if wrong:
            warnings.warn(
                f"megatron_abft: the compiled kernels disagree with the PyTorch path on {device} "
                f"({', '.join(wrong)}); that device uses the PyTorch path. Please report it with "
                "the output of tools/gpu_check.sh",
                RuntimeWarning,
                stacklevel=2,
            )
    return _trusted[device]


def block_sums(
    c: Tensor, col_block: int, row_block: int
) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
    """One read of ``c [..., m, n]`` for both sides of a check: the column side's sums and sizes
    ``[..., ceil(m / col_block), 2, n]`` and the row side's ``[..., ceil(n / row_block), 2, m]``
    (a block of 0 skips that side). Sums are (sum x, sum w x), sizes (sum |x|, sum w |x|) with
    w = 1, 2, ... from each block's start, in fp32 (fp64 for fp64). None where the kernels do
    not apply."""
    if not _serves(c):
        return None
    return torch.ops.megatron_abft.block_sums(c, col_block, row_block)


def row_products(a: Tensor, u: Tensor, z: Tensor) -> tuple[Tensor, Tensor] | None:
    """One read of the operand ``a [..., m, k]`` for the products the checksums of its GEMM need:
    ``a @ u^T`` and ``|a| @ z^T`` as ``[..., m, r]`` in ``u``'s dtype (fp32, fp64 for fp64),
    where ``u [..., r, k]`` and ``z [..., r', k]`` broadcast over a's batch dims. None where the
    kernels do not apply."""
    if not _products_apply(a, u, z):
        return None
    return torch.ops.megatron_abft.row_products(a, u, z)


def _products_apply(a: Tensor, u: Tensor, z: Tensor) -> bool:
    return _serves(a) and u.dim() == a.dim() and z.dim() == a.dim()


def _column_major(t: Tensor) -> bool:
    """Whether ``t``'s matrices are stored column by column (operand_pass reads rows)."""
    return t.stride(-2) == 1 and t.stride(-1) != 1 and t.shape[-2] > 1


def encode_pair_applies(a: Tensor, b: Tensor) -> bool:
    """Whether encode_pair's kernels take these operands."""
    if not (_serves(a) and _serves(b)) or a.dtype != b.dtype or a.device != b.device:
        return False
    x, y = a, b.mT  # the operands as rows of length k
    big, small = (x, y) if x.numel() >= y.numel() else (y, x)
    if small.numel() == 0 or small.dim() > big.dim():
        return False
    aligned = big.shape[big.dim() - small.dim() : -2]  # big's batch dims under small's
    if any(s not in (1, g) for s, g in zip(small.shape[:-2], aligned, strict=True)):
        return False  # small's batch dims must broadcast to big's
    return not _column_major(big)  # operand_pass reads rows


def encode_pair(
    a: Tensor, b: Tensor, alpha: float, block: int
) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
    """Both sides' checksum sums of ``alpha * a @ b`` (no bias) in one op, the larger operand
    read once: column sums ``[..., nb(m), 2, n]`` and magnitudes ``[..., nb(m), n]``, row sums
    ``[..., nb(n), 2, m]`` and magnitudes, as megatron_abft.check.checksum computes them. None where
    the kernels do not take these operands."""
    if not encode_pair_applies(a, b):
        return None
    return torch.ops.megatron_abft.encode_pair(a, b, alpha, block)


def add_bias(
    sums: tuple[Tensor, Tensor, Tensor, Tensor], bias: Tensor, m: int, block: int
) -> tuple[Tensor, ...] | None:
    """encode_pair's ``sums`` (both sides' sums and magnitudes of ``alpha * a @ b``, ``a`` with
    ``m`` rows) with ``bias [n]`` added to every row of C, in one op: the four, then the bias's
    magnitudes ``[nb(m), n]`` and ``[nb(n), 1]`` (checksum.Checksums.bias_magnitude). None where
    the kernels do not apply."""
    if not add_bias_applies(bias):
        return None
    return torch.ops.megatron_abft.add_bias(*sums, bias, m, block)


def add_bias_applies(bias: Tensor) -> bool:
    """Whether add_bias's kernels take ``bias``."""
    return _serves_device(bias.device) and bias.dtype in _KERNEL_DTYPES and bias.dim() == 1


def screen(
    c: Tensor,
    col_block: int,
    row_block: int,
    col: list[Tensor],
    row: list[Tensor],
    col_bounds: list[float],
    row_bounds: list[float],
) -> Tensor | None:
    """One read of ``c [..., m, n]`` compared with both sides' reference checksums: per matrix,
    the number of vectors whose differences exceed their thresholds (int32 ``[...]``). A side
    is ``[sums, magnitude]`` or ``[sums, magnitude, bias_magnitude]`` (``[]`` with a block of 0)
    in c's accumulation dtype, broadcasting to c's batch; its bounds are (out, gemm, floor,
    length) of csrc/kernels/abft.h's ScreenSide. None where the kernels do not apply."""
    if not _serves(c):
        return None
    return torch.ops.megatron_abft.screen(c, col_block, row_block, col, row, col_bounds, row_bounds)


def verify_correct(
    c: Tensor,
    sides: tuple,
    operands: tuple[Tensor, Tensor, float, Tensor | None],
    near_inf: float,
    capacity: int,
    ledger: Ledger | None = None,
) -> tuple[Tensor, ...] | None:
    """``screen``, then the flagged matrices of ``c`` located and corrected in place from the
    GEMM's ``operands`` (a, b, alpha, bias) in one op (csrc/kernels/abft_correct.h). ``sides`` are
    the arguments of ``screen`` after c (megatron_abft.check.sides.KernelSides). Per matrix:
    status (eec.CLEAN, CORRECTED, or 2: not settled, and put back bit for bit), kind, the most wrong
    flagged row and column, and the largest |d1|. At most ``capacity`` vectors per side and pass are
    corrected (eec's max_corrections, per matrix). With a ``ledger``, the same op also tallies what
    it found into it as ``tally`` does, on CUDA in the correction's launch, and returns failed
    after the five. None where the kernels do not apply."""
    a, b, alpha, bias = operands
    if not verify_correct_applies(c, a, b, bias):
        return None
    if ledger is None:
        return torch.ops.megatron_abft.verify_correct(
            c, *sides, a, b, alpha, bias, near_inf, capacity
        )
    return torch.ops.megatron_abft.verify_correct_tally(
        c, *sides, a, b, alpha, bias, near_inf, capacity, *_ledger_args(ledger)
    )


def verify_correct_applies(c: Tensor, a: Tensor, b: Tensor, bias: Tensor | None) -> bool:
    """Whether verify_correct's kernels take this output and these operands."""
    if not (_serves(c) and _serves(a) and _serves(b)) or a.device != c.device:
        return False
    return bias is None or (bias.dtype in _KERNEL_DTYPES and bias.device == c.device)


def tally(found: tuple[Tensor, Tensor, Tensor, Tensor, Tensor], ledger: Ledger) -> Tensor | None:
    """What a check ``found`` (per matrix status, kind, row, col, magnitude, as verify_correct
    returns them) adds to a guard's ``ledger``, in one op with no host read: its counts by
    outcome and kind, and the worst matrix's record where one is not clean (ledger.py);
    returns whether a matrix is uncorrectable (a bool tensor). None where the kernels do not
    apply."""
    status, *_, magnitude = found
    if not _serves_device(status.device) or magnitude.dtype not in (torch.float32, torch.float64):
        return None
    return torch.ops.megatron_abft.tally(*found, *_ledger_args(ledger))


def _ledger_args(ledger: Ledger) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return ledger.counts, ledger.clock, ledger.log, ledger.logged


def softmax_check(
    s: Tensor,
    sides: tuple,
    mask: Tensor | None,
    causal: bool,
    scale: float,
    block: int,
    vectors: tuple[Tensor, Tensor] | None,
) -> tuple[Tensor, ...] | None:
    """The fused softmax: Megatron's scale-mask-softmax of the scores ``s [..., sq, sk]`` (rows
    contiguous) in one read of ``s`` that also screens it and gives P's checksum pass, where the
    kernels apply (else None). ``sides`` are screen's arguments after c (check.sides.KernelSides;
    its NO_SCREEN for no screen); masked entries (``mask`` true, broadcast to ``s``, or j > i where
    ``causal``) become -10000 before the softmax, as Megatron's attention_mask_func; ``vectors``
    are pair_vectors' (u, z) for P's pass over blocks of ``block`` rows, or None. Returns P (in
    ``s``'s dtype), the screen's flagged counts per matrix, and P's block sums, sizes, products
    and magnitudes as operand_pass gives them (empty without ``vectors``)."""
    if not softmax_check_applies(s, mask, vectors):
        return None
    u, z = vectors if vectors is not None else (None, None)
    return torch.ops.megatron_abft.softmax_check(s, *sides, mask, causal, float(scale), block, u, z)


def softmax_correct_tally(
    s: Tensor,
    sides: tuple,
    mask: Tensor | None,
    causal: bool,
    scale: float,
    block: int,
    vectors: tuple[Tensor, Tensor] | None,
    operands: tuple[Tensor, Tensor, float],
    near_inf: float,
    capacity: int,
    ledger: Ledger,
) -> tuple[Tensor, ...]:
    """softmax_check with a screen (``sides``), for a sync-free check of the scores: the matrices
    of ``s`` it flags are corrected in place from the GEMM's ``operands`` (a, b, alpha: s = alpha
    a @ b), their rows of P and P's checksum pass are redone from the corrected scores, and what
    the correction found (as verify_correct) is tallied into ``ledger``, with no host read.
    Returns P, failed (whether a matrix stayed uncorrectable: its S put back as it was) and P's
    pass, as softmax_check. The caller has checked that the kernels take these inputs
    (softmax_check_applies)."""
    u, z = vectors if vectors is not None else (None, None)
    a, b, alpha = operands
    return torch.ops.megatron_abft.softmax_correct_tally(
        s,
        *sides,
        mask,
        causal,
        float(scale),
        block,
        u,
        z,
        a,
        b,
        float(alpha),
        near_inf,
        capacity,
        *_ledger_args(ledger),
    )


def softmax_check_applies(
    s: Tensor, mask: Tensor | None, vectors: tuple[Tensor, Tensor] | None
) -> bool:
    """Whether softmax_check's kernels take these inputs."""
    if not _serves(s) or s.stride(-1) != 1 or s.shape[-1] == 0 or s.shape[-2] == 0:
        return False
    if mask is not None and (mask.dtype != torch.bool or mask.device != s.device):
        return False
    return vectors is None or _products_apply(s, *vectors)


def pair_vectors(a: Tensor, b: Tensor, block: int) -> tuple[Tensor, Tensor] | None:
    """encode_pair's first half, for a pass over ``a`` made elsewhere (softmax_check): the
    smaller operand ``b``'s block sums (u, z) as that pass takes them. None where encode_pair
    would not take these operands or ``a`` is not the larger one."""
    if a.numel() < b.numel() or not encode_pair_applies(a, b):
        return None
    return torch.ops.megatron_abft.pair_vectors(a, b, block)


def encode_pair_from(
    a: Tensor, b: Tensor, alpha: float, block: int, sums: Tensor, sizes: Tensor
) -> tuple[Tensor, Tensor]:
    """encode_pair's second half: the column side's sums of ``alpha * a @ b`` and magnitudes,
    from the block ``sums`` and ``sizes`` of a pass over ``a`` made elsewhere with pair_vectors'
    u, z (softmax_check). The row side is that pass's products and magnitudes, taken times
    ``alpha`` (checksum.encode_from_pass)."""
    return torch.ops.megatron_abft.encode_pair_from(a, b, alpha, block, sums, sizes)


def _register_fake() -> None:
    @torch.library.register_fake("megatron_abft::tally")
    def _(status: Tensor, *args):
        return status.new_empty((), dtype=torch.bool)

    def found_like(c: Tensor) -> tuple[Tensor, ...]:
        batch = c.shape[:-2]
        dtype = torch.float64 if c.dtype == torch.float64 else torch.float32
        return (
            *(c.new_empty(batch, dtype=torch.int8) for _ in range(2)),
            *(c.new_empty(batch, dtype=torch.long) for _ in range(2)),
            c.new_empty(batch, dtype=dtype),
        )

    @torch.library.register_fake("megatron_abft::verify_correct")
    def _(c: Tensor, *args):
        return found_like(c)

    @torch.library.register_fake("megatron_abft::verify_correct_tally")
    def _(c: Tensor, *args):
        return *found_like(c), c.new_empty((), dtype=torch.bool)

    def softmax_outputs(s: Tensor, block: int, u, z, second: Tensor) -> tuple[Tensor, ...]:
        dtype = torch.float64 if s.dtype == torch.float64 else torch.float32
        batch, (m, n) = s.shape[:-2], s.shape[-2:]
        if u is None:
            return s.new_empty(s.shape), second, *(s.new_empty(0, dtype=dtype) for _ in range(4))
        sums = (*batch, -(-m // block), 2, n)
        return (
            s.new_empty(s.shape),
            second,
            s.new_empty(sums, dtype=dtype),
            s.new_empty(sums, dtype=dtype),
            s.new_empty((*batch, m, u.shape[-2]), dtype=dtype),
            s.new_empty((*batch, m, z.shape[-2]), dtype=dtype),
        )

    @torch.library.register_fake("megatron_abft::softmax_check")
    def _(s: Tensor, *args):
        block, u, z = args[9:12]
        return softmax_outputs(s, block, u, z, s.new_empty(s.shape[:-2], dtype=torch.int32))

    @torch.library.register_fake("megatron_abft::softmax_correct_tally")
    def _(s: Tensor, *args):
        block, u, z = args[9:12]
        return softmax_outputs(s, block, u, z, s.new_empty((), dtype=torch.bool))

    @torch.library.register_fake("megatron_abft::add_bias")
    def _(col: Tensor, col_magnitude: Tensor, row: Tensor, row_magnitude: Tensor, bias, m, block):
        n = bias.shape[0]
        return (
            *(t.new_empty(t.shape) for t in (col, col_magnitude, row, row_magnitude)),
            col.new_empty((-(-m // block), n)),
            col.new_empty((-(-n // block), 1)),
        )

    @torch.library.register_fake("megatron_abft::screen")
    def _(c: Tensor, col_block, row_block, col, row, col_bounds, row_bounds):
        return c.new_empty(c.shape[:-2], dtype=torch.int32)

    @torch.library.register_fake("megatron_abft::block_sums")
    def block_sums_like(c: Tensor, col_block: int, row_block: int):
        batch, (m, n) = c.shape[:-2], c.shape[-2:]
        dtype = torch.float64 if c.dtype == torch.float64 else torch.float32
        col = (*batch, -(-m // col_block) if col_block else 0, 2, n)
        row = (*batch, -(-n // row_block) if row_block else 0, 2, m)
        return (
            *(c.new_empty(col, dtype=dtype) for _ in range(2)),
            *(c.new_empty(row, dtype=dtype) for _ in range(2)),
        )

    @torch.library.register_fake("megatron_abft::operand_pass")
    def _(a: Tensor, block: int, u: Tensor, z: Tensor, scale: float = 1.0):
        batch, (m, k) = a.shape[:-2], a.shape[-2:]
        sums = (*batch, -(-m // block), 2, k)
        return (
            a.new_empty(sums, dtype=u.dtype),
            a.new_empty(sums, dtype=u.dtype),
            a.new_empty((*batch, m, u.shape[-2]), dtype=u.dtype),
            a.new_empty((*batch, m, z.shape[-2]), dtype=z.dtype),
        )

    @torch.library.register_fake("megatron_abft::row_products")
    def row_products_like(a: Tensor, u: Tensor, z: Tensor, scale: float = 1.0):
        batch, m = a.shape[:-2], a.shape[-2]
        return a.new_empty((*batch, m, u.shape[-2]), dtype=u.dtype), a.new_empty(
            (*batch, m, z.shape[-2]), dtype=z.dtype
        )

    @torch.library.register_fake("megatron_abft::mma_products")
    def _(x: Tensor, u: Tensor, z: Tensor, scale: float = 1.0):
        return row_products_like(x, u, z, scale)

    @torch.library.register_fake("megatron_abft::block_sums_pair")
    def _(a: Tensor, a_col: int, a_row: int, b: Tensor, b_col: int, b_row: int):
        return *block_sums_like(a, a_col, a_row), *block_sums_like(b, b_col, b_row)

    @torch.library.register_fake("megatron_abft::row_products_pair")
    def _(a: Tensor, u: Tensor, z: Tensor, scale: float, b: Tensor, v: Tensor, y: Tensor, b_scale):
        return *row_products_like(a, u, z, scale), *row_products_like(b, v, y, b_scale)
