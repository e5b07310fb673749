"""Reference checksums of C = alpha * A @ B + bias, computed from the inputs (docs/abft.md §1).

Column checksums sum C over its rows, block by block: for each block of at most ``block`` rows
and each column j, the pair (sum_i C_ij, sum_i (i+1) C_ij) with i counted from the block's start,
obtained as ([e w]^T A) @ B. Row checksums are the column checksums of C^T = B^T A^T. Beside the
pair each block carries the magnitude sum_i (|alpha| |A| @ |B| + |bias|)_ij that scales the
detection threshold (megatron_abft.check.tolerance). Everything is accumulated in fp32 (fp64 for
fp64 inputs), whatever the inputs' dtype. The per-block sums of A come from the compiled kernels
(megatron_abft.ops.compiled) where they are built; the PyTorch code beside them is the reference.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_abft.ops import compiled

FLOATING = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


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
class Checksums:
    """Reference checksums of the columns of a batch of matrices, one side of a check.

    ``sums`` is ``[..., nblocks, 2, n]`` (plain and weighted sum of each column over each block of
    rows), ``magnitude`` is ``[..., nblocks, n]``. Row checksums of C are stored as the column
    checksums of C^T, so ``n`` is then the number of rows of C.
    """

    sums: Tensor
    magnitude: Tensor
    block: int
    length: int
    """Number of entries summed per column (rows of C for column checksums)."""
    inner: int
    """Inner dimension k of the GEMM, for the rounding bound."""
    bias_magnitude: Tensor | None = None
    """Sum of |bias| over each block (broadcasts to ``magnitude``), None without a bias. Covers
    the extra rounding when the bias is added after the product is rounded, as Megatron does."""

    @property
    def nblocks(self) -> int:
        return self.sums.shape[-3]


def accumulation_dtype(*tensors: Tensor) -> torch.dtype:
    """fp64 if any input is fp64, else fp32: the precision every checksum is kept in."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def nblocks(length: int, block: int) -> int:
    return -(-length // block)


def as_blocks(x: Tensor, block: int, dtype: torch.dtype = torch.float32, dim: int = -2) -> Tensor:
    """Split dim ``dim`` (-2 or -1) of ``x`` into ``[nblocks, block]`` in ``dtype``, padding it with
    zeros: ``[..., L, n]`` becomes ``[..., nblocks, block, n]`` or ``[..., m, L]`` becomes
    ``[..., m, nblocks, block]``."""
    length = x.shape[dim]
    x = x.to(dtype)
    pad = nblocks(length, block) * block - length
    if pad:
        x = F.pad(x, (0, pad) if dim == -1 else (0, 0, 0, pad))
    return x.unflatten(dim, (-1, block))


_CONSTANTS: dict[tuple, Tensor] = {}
_MAX_CONSTANTS = 256


def _constant(key: tuple, make: Callable[[], Tensor]) -> Tensor:
    """``make()``, kept under ``key`` where keeping it is safe: a plain tensor, not one made
    while a CUDA graph is captured (its kernels have not run yet) nor a fake tensor of a trace.
    Callers must not write to it."""
    if torch.compiler.is_compiling():  # a trace keeps no state of its own
        return make()
    found = _CONSTANTS.get(key)
    if found is not None:
        return found
    value = make()
    capturing = value.is_cuda and torch.cuda.is_current_stream_capturing()
    if type(value) is Tensor and not capturing and len(_CONSTANTS) < _MAX_CONSTANTS:
        _CONSTANTS[key] = value
    return value


def block_weights(block: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """The ``[2, block]`` checksum weights: e = (1, ..., 1) and w = (1, ..., block). Made once
    per block, device and dtype (_constant): do not write to it."""

    def make() -> Tensor:
        w = torch.arange(1, block + 1, device=device, dtype=dtype)
        return torch.stack([torch.ones_like(w), w])

    return _constant(("weights", block, device, dtype), make)


def _block_counts(length: int, block: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """``[nb, 2, 1]``: each block's number of rows and the sum of their weights, out of
    ``length`` rows: what a bias adds to the column sums of each block, per unit of bias. Made
    once per shape, device and dtype (_constant): do not write to it."""

    def make() -> Tensor:
        rows = as_blocks(torch.ones(length, 1, device=device), block, dtype)  # [nb, block, 1]
        return block_weights(block, device, dtype) @ rows

    return _constant(("counts", length, block, device, dtype), make)


def broadcast_shapes(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    """torch.broadcast_shapes for plain int shapes, without its symbolic-shape machinery (it
    costs more than a whole clean check's tensor ops); raises RuntimeError where they differ."""
    ndim = max(len(s) for s in shapes)
    result = [1] * ndim
    for shape in shapes:
        for i, size in enumerate(shape, ndim - len(shape)):
            if size != result[i] and size != 1:
                if result[i] != 1:
                    raise RuntimeError(f"shapes {shapes} do not broadcast")
                result[i] = size
    return tuple(result)


def _check_operands(a: Tensor, b: Tensor, bias: Tensor | None, block: int) -> None:
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in FLOATING:
            raise TypeError(f"{name} must be fp64, fp32, bf16 or fp16; got {t.dtype}")
        if t.dim() < 2:
            raise ValueError(
                f"{name} must have at least 2 dims [..., rows, cols]; got {tuple(t.shape)}"
            )
    if a.device != b.device:
        raise ValueError(f"a is on {a.device} but b is on {b.device}; put both on one device")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(
            f"inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)} "
            f"(a.shape[-1] must equal b.shape[-2])"
        )
    try:
        broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except RuntimeError:
        raise ValueError(
            f"batch dims of a {tuple(a.shape[:-2])} and b {tuple(b.shape[:-2])} do not broadcast"
        ) from None
    if bias is not None:
        if bias.shape != (b.shape[-1],):
            raise ValueError(f"bias must have shape ({b.shape[-1]},); got {tuple(bias.shape)}")
        if bias.device != a.device:
            raise ValueError(f"bias is on {bias.device} but a is on {a.device}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 2:
        raise ValueError(f"block must be an int >= 2; got {block!r}")


def _project(x: Tensor, sums: Tensor, sizes: Tensor) -> tuple[Tensor, Tensor]:
    """``sums @ x^T`` and ``sizes @ |x|^T`` for an operand ``x [..., p, k]`` and checksum rows
    ``sums [..., q, k]``, ``sizes [..., q', k]``: ``[..., q, p]`` and ``[..., q', p]``.

    The operand, the large factor, is read in its own layout and never copied: by the compiled
    kernels in one read of x for both products (row by row, or column by column where x is
    column-major), else by BLAS, given x as the operand whose layout it reads fastest (x's rows
    for a row-major x, x^T's for a column-major one). The batch dims along which ``x`` is
    broadcast are folded into the GEMM's columns."""
    batch = broadcast_shapes(x.shape[:-2], sums.shape[:-2])
    if x.shape[:-2] == batch:  # nothing to fold
        products = compiled.row_products(x, sums, sizes)
        if products is not None:
            return products[0].mT, products[1].mT
        x = x.to(sums.dtype)
        if x.stride(-2) == 1 and x.stride(-1) != 1:  # column-major: x^T is row-major
            return sums @ x.mT, sizes @ x.abs().mT
        return (x @ sums.mT).mT, (x.abs() @ sizes.mT).mT
    p, k = x.shape[-2:]
    x = x.reshape((1,) * (len(batch) + 2 - x.dim()) + x.shape)
    fold = [d for d in range(len(batch)) if x.shape[d] == 1 and batch[d] > 1]
    keep = [d for d in range(len(batch)) if d not in fold]
    kept, folded = [batch[d] for d in keep], [batch[d] for d in fold]
    x = x.reshape(*kept, p, k)  # a view: x is 1 along the folded dims

    def fold_rows(rows: Tensor) -> Tensor:  # [*batch, q, k] -> [*kept, folded * q, k]
        q = rows.shape[-2]
        rows = rows.expand(*batch, q, k).permute(*keep, *fold, -2, -1)
        return rows.reshape(*kept, math.prod(folded) * q, k)

    products = _project(x, fold_rows(sums), fold_rows(sizes))  # [*kept, folded * q, p]
    order = [0] * len(batch)
    for i, d in enumerate(keep):
        order[d] = i
    for i, d in enumerate(fold):
        order[d] = len(keep) + i
    return tuple(t.unflatten(-2, (*folded, -1)).permute(*order, -2, -1) for t in products)


def _operand_sums(a: Tensor, block: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """[e w]^T A and sum |A| over each block of rows of ``a [..., m, k]``: ``[..., nb, 2, k]`` and
    ``[..., nb, k]`` in ``dtype``, from the compiled kernels where they apply (one read of A)."""
    if (a.dtype == torch.float64) == (dtype == torch.float64):
        fused = compiled.block_sums(a, block, 0)
        if fused is not None:
            return fused[0], fused[1][..., 0, :]
    ab = as_blocks(a, block, dtype)  # [..., nb, block, k]
    return block_weights(block, a.device, dtype) @ ab, ab.abs().sum(-2)


def _scaled(sums: Tensor, magnitude: Tensor, alpha: float) -> tuple[Tensor, Tensor]:
    """``[..., 2 nb, n]`` products as ``[..., nb, 2, n]`` sums, and magnitudes, times alpha."""
    sums = sums.unflatten(-2, (-1, 2))
    return (sums, magnitude) if alpha == 1 else (alpha * sums, abs(alpha) * magnitude)


def _column_sums(a: Tensor, b: Tensor, alpha: float, block: int) -> tuple[Tensor, Tensor]:
    dtype = accumulation_dtype(a, b)
    weighted, size = _operand_sums(a.detach(), block, dtype)
    return _scaled(*_project(b.detach().mT, weighted.flatten(-3, -2), size), alpha)


def _both_sides_sums(
    a: Tensor, b: Tensor, alpha: float, block: int
) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]] | None:
    """Both sides' (sums, magnitude) in one op of the compiled kernels
    (csrc/bindings/abft_encode.cpp: the larger operand read once for its block sums and its
    products with the smaller one's sums, the smaller one twice; the same steps as _operand_sums
    and _project). None where the kernels cannot do that; encode then takes one side at a time."""
    found = compiled.encode_pair(a.detach(), b.detach(), alpha, block)
    if found is None:
        return None
    col, col_magnitude, row, row_magnitude = found
    return (col, col_magnitude), (row, row_magnitude)


@torch.no_grad()
def encode_columns(
    a: Tensor, b: Tensor, *, alpha: float = 1.0, bias: Tensor | None = None, block: int = 256
) -> Checksums:
    """Column checksums of ``C = alpha * a @ b + bias`` over blocks of ``block`` rows.

    ``a`` is ``[..., m, k]``, ``b`` is ``[..., k, n]`` (batch dims broadcast), ``bias`` is ``[n]``
    and added to every row. Returns ``sums [..., ceil(m/block), 2, n]``.
    """
    _check_operands(a, b, bias, block)
    return _columns(*_column_sums(a, b, alpha, block), a, b, bias, block)


def _columns(
    sums: Tensor, magnitude: Tensor, a: Tensor, b: Tensor, bias: Tensor | None, block: int
) -> Checksums:
    """encode_columns' Checksums from the product's column sums: the bias added."""
    m = a.shape[-2]
    if bias is not None:
        # each block adds bias_j once per row: (L_b, sum of its weights) times bias_j
        counts = _block_counts(m, block, a.device, sums.dtype)  # [nb, 2, 1]
        bias32 = bias.detach().to(sums.dtype)
        sums = sums + counts * bias32
        bias_magnitude = counts[:, 0] * bias32.abs()  # [nb, n]
        return Checksums(sums, magnitude + bias_magnitude, block, m, a.shape[-1], bias_magnitude)
    return Checksums(sums, magnitude, block=block, length=m, inner=a.shape[-1])


@torch.no_grad()
def encode_rows(
    a: Tensor, b: Tensor, *, alpha: float = 1.0, bias: Tensor | None = None, block: int = 256
) -> Checksums:
    """Row checksums of ``C = alpha * a @ b + bias``: the column checksums of C^T over blocks of
    ``block`` columns. Returns ``sums [..., ceil(n/block), 2, m]``."""
    _check_operands(a, b, bias, block)
    return _rows(*_column_sums(b.mT, a.mT, alpha, block), a, b, bias, block)


def _rows(
    sums: Tensor, magnitude: Tensor, a: Tensor, b: Tensor, bias: Tensor | None, block: int
) -> Checksums:
    """encode_rows' Checksums from the product's row sums: the bias added."""
    if bias is not None:
        # every row i of C gains the same per-block sums of the bias
        bias_blocks = as_blocks(bias.detach().unsqueeze(-1), block, sums.dtype)  # [nb, block, 1]
        sums = sums + block_weights(block, a.device, sums.dtype) @ bias_blocks
        bias_magnitude = bias_blocks.abs().sum(-2)  # [nb, 1]
        return Checksums(
            sums, magnitude + bias_magnitude, block, b.shape[-1], a.shape[-1], bias_magnitude
        )
    return Checksums(sums, magnitude, block=block, length=b.shape[-1], inner=a.shape[-1])


def encode(
    a: Tensor, b: Tensor, *, alpha: float = 1.0, bias: Tensor | None = None, block: int = 256
) -> tuple[Checksums, Checksums]:
    """Both sides' checksums of ``C = alpha * a @ b + bias``: (columns, rows). With the
    compiled kernels the larger operand is read once for both sides."""
    _check_operands(a, b, bias, block)
    with torch.no_grad():
        both = _both_sides_sums(a, b, alpha, block)
        if both is None:
            both = (_column_sums(a, b, alpha, block), _column_sums(b.mT, a.mT, alpha, block))
        (col, col_magnitude), (row, row_magnitude) = both
        m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
        biased = None if bias is None else compiled.add_bias(both[0] + both[1], bias, m, block)
        if biased is not None:  # one op of the compiled kernels for the bias's terms
            col, col_magnitude, row, row_magnitude, col_bias, row_bias = biased
            return (
                Checksums(col, col_magnitude, block, m, k, col_bias),
                Checksums(row, row_magnitude, block, n, k, row_bias),
            )
        return (
            _columns(col, col_magnitude, a, b, bias, block),
            _rows(row, row_magnitude, a, b, bias, block),
        )


def encode_from_pass(
    a: Tensor, b: Tensor, block: int, found: tuple[Tensor, ...]
) -> tuple[Checksums, Checksums]:
    """``encode(a, b, block=block)`` from a pass over ``a`` made elsewhere: ``found`` are its
    block sums, sizes, products and magnitudes with compiled.pair_vectors(a, b, block), as
    compiled.softmax_check gives them for the context GEMM P @ V. Needs the compiled kernels. The
    row side is views of the pass's products ``[..., m, 2 nb(n)]`` and magnitudes."""
    sums, sizes, products, magnitudes = found
    col, col_magnitude = compiled.encode_pair_from(a, b, 1.0, block, sums, sizes)
    row, row_magnitude = products.mT.unflatten(-2, (-1, 2)), magnitudes.mT
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    return Checksums(col, col_magnitude, block, m, k), Checksums(row, row_magnitude, block, n, k)
