"""Faults landed inside the flash kernels (compiled in only when one is armed: the kernels'
``INJECT`` switch), in a section's logical matrix:

| section | matrix, per (batch, head) | computed in |
|---|---|---|
| scores | S = Q K^T [Nq, Nk] | the forward, a tile a KV block |
| context | P~V [Nq, d] | the forward, a partial product a KV block |
| bwd_scores | S, recomputed [Nq, Nk] | the dK/dV kernel (S^T), then the dQ kernel |
| grad_probs | dP = dO V^T [Nq, Nk] | the dK/dV kernel (dP^T), then the dQ kernel |
| grad_v | the head's P^T dO [Nk, d] | the dK/dV kernel, a partial product a query block |
| grad_k | the head's dS^T Q [Nk, d] | the dK/dV kernel, a partial product a query block |
| grad_q | dS K [Nq, d] | the dQ kernel, a partial product a KV block |

A fault corrupts the fp32 GEMM result (a bitflip flips a bit of the fp32 value). A transient one
hits the first computation of each element it covers (for a product summed over blocks, the
first block's; for the backward's S and dP, the dK/dV kernel's); a persistent one hits every
computation, the kernels' recomputations included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_abft.config import FLASH_SECTIONS
from megatron_abft.faults import Injection, TensorFault, fill_value, flip_mask, locate
from megatron_abft.flash.tiles import blocks, padded_head_dim


@dataclass(frozen=True)
class FlashFault:
    """One fault for the flash kernels: a region of a section's logical matrix."""

    section: str
    """One of FLASH_SECTIONS."""
    fault: TensorFault
    """What and where (kind, pattern, position, matrix as batch * heads + head, seed)."""
    persistent: bool = False
    """Every computation (True) or the first only (False)."""

    def __post_init__(self) -> None:
        if self.section not in FLASH_SECTIONS:
            raise ValueError(
                f"FlashFault.section: unknown section {self.section!r}; "
                f"choose from {', '.join(FLASH_SECTIONS)}"
            )

    def landing(self, matrices: int, n_q: int, n_k: int, head_dim: int) -> Injection:
        """Where it lands in a call of ``matrices`` (batch * heads) matrices: the same each
        call, its positions drawn from its seed."""
        return locate(self.fault, matrices, *matrix_shape(self.section, n_q, n_k, head_dim))[0]


def matrix_shape(section: str, n_q: int, n_k: int, head_dim: int) -> tuple[int, int]:
    """Rows and columns of ``section``'s logical matrix."""
    if section in ("scores", "bwd_scores", "grad_probs"):
        return n_q, n_k
    if section in ("grad_v", "grad_k"):
        return n_k, head_dim
    return n_q, head_dim


def kernel_args(
    fault: FlashFault, matrices: int, n_q: int, n_k: int, head_dim: int, device: torch.device
) -> tuple[Tensor, Injection]:
    """The kernels' INJ argument for ``fault`` (int32, as kernels.py's I_* lay it out) in a call
    of ``matrices`` (batch * heads) matrices, and where it lands."""
    m, n = matrix_shape(fault.section, n_q, n_k, head_dim)
    where, generator = locate(fault.fault, matrices, m, n)
    flip, value = 0, 0.0
    if fault.fault.kind == "bitflip":
        flip = flip_mask(fault.fault, generator, 32)
    else:
        value = fill_value(fault.fault, generator)
    bits = int(torch.tensor(value, dtype=torch.float32).view(torch.int32))
    args = [
        FLASH_SECTIONS.index(fault.section),
        where.batch_index,
        *where.rows,
        *where.cols,
        flip,
        bits,
        int(fault.persistent),
    ]
    return torch.tensor(args, dtype=torch.int32, device=device), where


def first_computations(
    q: Tensor, k: Tensor, v: Tensor, do: Tensor, causal: bool = True, scale: float | None = None
) -> dict[str, Tensor]:
    """Each section's matrix of matrix 0 as its first computation in the kernels makes it, in
    float64 (q, k, v, do [batch, heads, seq, dim], one KV head per query head): S and dP whole;
    the context and dQ as the first KV block's product; dV and dK, per key, as the first query
    block's. A fault of kind "value" sets an element of these: one at ``x`` plus an error."""
    dtype = q.dtype
    q, k, v, do = (t[0, 0].double().cpu() for t in (q, k, v, do))
    n_q, dim = q.shape
    n_k = k.shape[0]
    scale = dim**-0.5 if scale is None else scale
    visible = torch.ones(n_q, n_k, dtype=torch.bool)
    if causal:
        visible = visible.tril()
    s = q @ k.T
    probs = torch.softmax((s * scale).masked_fill(~visible, -math.inf), -1)
    dp = do @ v.T
    ds = probs * (dp - (do * (probs @ v)).sum(-1, keepdim=True))
    width = padded_head_dim(dim)
    fwd, dkdv, dq = (blocks(kernel, width, dtype) for kernel in ("forward", "dkdv", "dq"))
    first = slice(0, fwd.block_n)
    s0 = (s[:, first] * scale).masked_fill(~visible[:, first], -math.inf)
    p0 = torch.exp(s0 - s0.amax(-1, keepdim=True)).to(dtype).double()
    keys = torch.arange(n_k)
    lo = torch.zeros_like(keys)
    if causal:  # a key block's first query block: the diagonal's
        lo = (keys // dkdv.block_n * dkdv.block_n) // dkdv.block_m * dkdv.block_m
    rows = lo[:, None] + torch.arange(dkdv.block_m)[None, :]
    taken = rows < n_q
    if causal:
        taken &= rows >= keys[:, None]
    rows = rows.clamp(max=n_q - 1)

    def per_key(grid: Tensor, operand: Tensor) -> Tensor:
        part = torch.where(taken, grid.T.gather(1, rows), 0.0).to(dtype).double()
        return torch.einsum("nm,nmd->nd", part, operand[rows])

    dq_first = slice(0, dq.block_n)
    return {
        "scores": s,
        "bwd_scores": s,
        "grad_probs": dp,
        "context": p0 @ v[first],
        "grad_q": ds[:, dq_first].to(dtype).double() @ k[dq_first],
        "grad_v": per_key(probs, do),
        "grad_k": per_key(ds, q),
    }
