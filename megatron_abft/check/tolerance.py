"""Detection thresholds: how far a clean checksum difference can drift from zero.

For one checked vector x (length L) of C = alpha * A @ B + bias with inner dimension k, the
difference between the carried checksum and the one recomputed from C is bounded by (docs/abft.md)

    tau   = scale * (u_out * S   + L   * f + g * M)
    tau_w = scale * (u_out * S_w + L*L * f + g * L * M)      (weighted checksum)

with S = sum |x_i|, S_w = sum w_i |x_i|, M = sum_i (|alpha| |A| @ |B| + |bias|)_i, the output's
unit roundoff u_out and subnormal spacing f, and g = 2 u_in + 2 (k + L + 2) u_acc collecting the
rounding of the GEMM's inputs (TF32) and of every fp32 sum on both sides of the comparison.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

_FLOATING = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the machine epsilon: the relative error of one rounding to ``dtype``."""
    return torch.finfo(dtype).eps / 2


@dataclass(frozen=True)
class Rounding:
    """Unit roundoffs of one GEMM: output rounding, subnormal floor, input and accumulation."""

    output: float
    floor: float
    inputs: float
    accumulation: float

    def gemm_factor(self, inner: int, length: int) -> float:
        """g of the module docstring: relative error per unit of |A|@|B| magnitude."""
        return 2 * self.inputs + 2 * (inner + length + 2) * self.accumulation


def gemm_rounding(dtype: torch.dtype, device: torch.device) -> Rounding:
    """The rounding model of a GEMM producing ``dtype`` on ``device``.

    CPU GEMMs accumulate in fp32 (fp64 for fp64) and round once. On CUDA, torch's reduced-precision
    switches change that: TF32 rounds fp32 inputs to 10 mantissa bits, and reduced-precision
    reductions may sum fp16/bf16 partial products in the output dtype.
    """
    if dtype not in _FLOATING:
        raise TypeError(f"ABFT checks floating-point GEMMs; got {dtype}")
    output = unit_roundoff(dtype)
    info = torch.finfo(dtype)
    floor = info.smallest_normal * info.eps / 2
    accumulation = unit_roundoff(torch.float64 if dtype == torch.float64 else torch.float32)
    inputs = 0.0
    if device.type == "cuda":
        tf32, fp16_reduced, bf16_reduced = cuda_matmul_switches()
        if dtype == torch.float32 and tf32:
            inputs = 2.0**-11
        elif dtype == torch.float16 and fp16_reduced:
            accumulation = output
        elif dtype == torch.bfloat16 and bf16_reduced:
            accumulation = output
    return Rounding(output=output, floor=floor, inputs=inputs, accumulation=accumulation)


def cuda_matmul_switches() -> tuple[bool, bool, bool]:
    """torch's switches that change how a CUDA GEMM rounds (gemm_rounding): TF32 for fp32, and
    reduced-precision reductions for fp16 and bf16."""
    matmul = torch.backends.cuda.matmul
    return (
        matmul.allow_tf32,
        matmul.allow_fp16_reduced_precision_reduction,
        matmul.allow_bf16_reduced_precision_reduction,
    )


def threshold_terms(
    rounding: Rounding, *, length: int, inner: int, scale: float
) -> tuple[float, float, float]:
    """The constants of tau in the module docstring: (scale u_out, scale g, scale L f)."""
    return (
        scale * rounding.output,
        scale * rounding.gemm_factor(inner, length),
        scale * length * rounding.floor,
    )


def thresholds(
    rounding: Rounding,
    *,
    size: Tensor,
    size_w: Tensor,
    magnitude: Tensor,
    bias_magnitude: Tensor | None,
    length: int,
    inner: int,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """tau and tau_w of the module docstring for vectors with S = ``size``, S_w = ``size_w``,
    M = ``magnitude``. With a bias, the product is rounded once before the bias is added, which
    adds u_out * (S + sum |bias|) (and its weighted analogue)."""
    if bias_magnitude is not None:
        size, size_w = 2 * size + bias_magnitude, 2 * size_w + length * bias_magnitude
    out, g, floor = threshold_terms(rounding, length=length, inner=inner, scale=scale)
    tau = torch.add(size * out, magnitude, alpha=g).add_(floor)  # few ops: they run per check
    tau_w = torch.add(size_w * out, magnitude, alpha=g * length).add_(floor * length)
    return tau, tau_w
