"""``flash_attention``: the protected flash attention as a differentiable PyTorch function.

Two ``torch.library`` custom ops (forward, backward; fakes registered, so torch.compile traces
them) joined by a ``torch.autograd.Function``. Each op's kernels fold what they found into a
FlashLedger's device tensors, which it declares as mutated: no host synchronisation. Where
nothing traces or watches the call, the Function calls the ops' bodies directly: the same
launches without the dispatcher's hops through Python (a third of the call's host time).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from megatron_abft.config import FLASH_SECTIONS, FORWARD_SECTIONS
from megatron_abft.flash import checksums, launch, tiles
from megatron_abft.flash.faults import FlashFault, kernel_args
from megatron_abft.flash.ledger import FlashLedger

FORWARD = frozenset(FLASH_SECTIONS) & frozenset(FORWARD_SECTIONS)
"""The flash sections of the forward (scores, context); the others are the backward's."""
_DEFAULT_LEDGERS: dict[torch.device, FlashLedger] = {}


def default_ledger(device: torch.device | str) -> FlashLedger:
    """The ledger of the calls on ``device`` that name none: what they find is kept here."""
    device = torch.device(device)
    if device not in _DEFAULT_LEDGERS:
        _DEFAULT_LEDGERS[device] = FlashLedger.on(device)
    return _DEFAULT_LEDGERS[device]


def _forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    counts: Tensor,
    clock: Tensor,
    log: Tensor,
    logged: Tensor,
    inject: Tensor | None,
    causal: bool,
    scale: float,
    due: int,
    tol: float,
    near_inf: float,
) -> tuple[Tensor, Tensor]:
    checks = launch.Checks(due, tol, near_inf)
    found = _found(checks.kernel_due("forward"), q)
    ledger = (counts, clock, log, logged)
    return launch.forward(q, k, v, causal, scale, checks, found, ledger, inject)


_forward_op = torch.library.custom_op(
    "megatron_abft::flash_forward", _forward, mutates_args=("counts", "log", "logged")
)


@_forward_op.register_fake
def _(q, k, v, counts, clock, log, logged, inject, causal, scale, due, tol, near_inf):
    rows = -(-q.shape[2] // checksums.ROWS) * checksums.ROWS  # the LSE, padded as the kernel's
    return torch.empty_like(q), q.new_empty(*q.shape[:2], rows, dtype=torch.float32)


def _backward(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    counts: Tensor,
    clock: Tensor,
    log: Tensor,
    logged: Tensor,
    inject: Tensor | None,
    causal: bool,
    scale: float,
    due: int,
    tol: float,
    near_inf: float,
) -> tuple[Tensor, Tensor, Tensor]:
    checks = launch.Checks(due, tol, near_inf)
    found = _found(checks.kernel_due("dkdv") or checks.kernel_due("dq"), q)
    ledger = (counts, clock, log, logged)
    return launch.backward(do, q, k, v, o, lse, causal, scale, checks, found, ledger, inject)


_backward_op = torch.library.custom_op(
    "megatron_abft::flash_backward", _backward, mutates_args=("counts", "log", "logged")
)


@_backward_op.register_fake
def _(do, q, k, v, o, lse, counts, clock, log, logged, inject, causal, scale, due, tol, near_inf):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _found(checked: bool, q: Tensor) -> launch.Findings:
    """Where a call's kernels report: a zeroed buffer when they check, else placeholders."""
    if checked:
        return launch.Findings.empty(q.shape[0] * q.shape[1], q.device)
    return launch.Findings.unchecked(q.device)


def _traced() -> bool:
    """Whether something traces or watches the ops (torch.compile, a fake or functional mode, a
    dispatch mode such as the profiler's FLOP counter): they then go through the dispatcher."""
    return torch.compiler.is_compiling() or is_in_torch_dispatch_mode()


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, counts, clock, log, logged, inject_fwd, inject_bwd, *options):
        o, lse = (_forward_op if _traced() else _forward)(
            q, k, v, counts, clock, log, logged, inject_fwd, *options
        )
        ctx.save_for_backward(q, k, v, o, lse, inject_bwd)
        # the ledger is state the backward writes into as it is then, not a saved value: a
        # step that moves its clock, or a reset of its counters, before this backward ran (a
        # pipeline schedule's next forward) is no error
        ctx.ledger = (counts, clock, log, logged)
        ctx.options = options
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, inject_bwd = ctx.saved_tensors
        counts, clock, log, logged = ctx.ledger
        dq, dk, dv = (_backward_op if _traced() else _backward)(
            do, q, k, v, o, lse, counts, clock, log, logged, inject_bwd, *ctx.options
        )
        return dq, dk, dv, *([None] * (6 + len(ctx.options)))


def due_mask(sections: Iterable[str]) -> int:
    """The kernels' ``due`` bits for a set of FLASH_SECTIONS."""
    mask = 0
    for section in sections:
        if section not in FLASH_SECTIONS:
            raise ValueError(
                f"flash_attention: unknown section {section!r}; "
                f"choose from {', '.join(FLASH_SECTIONS)}"
            )
        mask |= 1 << FLASH_SECTIONS.index(section)
    return mask


def check_inputs(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Raise, naming the bad value, for inputs the kernels do not take."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ValueError(
                f"flash_attention: {name} must be a 4-d tensor [batch, heads, seq, head_dim], "
                f"got {tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}"
            )
    if q.dtype not in tiles.DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(
            f"flash_attention: q, k and v must share one dtype of float32, bfloat16, float16; "
            f"got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if not (q.device == k.device == v.device) or q.device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"flash_attention: q, k, v on {q.device}, {k.device}, {v.device}; the kernels run "
            "on one CUDA device, or on CPU"
        )
    if q.device.type == "cuda" and q.dtype not in tiles.GPU_DTYPES:
        raise ValueError(
            f"flash_attention: on a GPU the kernels take bfloat16 or float16, not {q.dtype} "
            "(they accumulate in fp32); cast q, k and v, or use the unfused attention"
        )
    if k.shape != v.shape:
        raise ValueError(f"flash_attention: k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    batch, heads, n_q, dim = q.shape
    if k.shape[0] != batch or k.shape[3] != dim:
        raise ValueError(
            f"flash_attention: q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch or "
            "head dim"
        )
    if k.shape[1] < 1 or heads % k.shape[1]:
        raise ValueError(
            f"flash_attention: {heads} query heads do not split into {k.shape[1]} KV heads"
        )
    if min(batch, heads, n_q, k.shape[2], dim) < 1:
        raise ValueError(f"flash_attention: empty input, q {tuple(q.shape)} k {tuple(k.shape)}")
    tiles.padded_head_dim(dim)


def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    sections: Iterable[str] = FLASH_SECTIONS,
    threshold_scale: float = 1.0,
    near_inf: float = 1e10,
    ledger: FlashLedger | None = None,
    faults: Sequence[FlashFault] = (),
) -> Tensor:
    """softmax(softmax_scale * q k^T) v, every tile GEMM of the forward and the backward checked
    and corrected in the kernels (docs/abft.md, "The flash path").

    q is [batch, heads, seq_q, head_dim], k and v [batch, kv_heads, seq_k, head_dim] with
    heads a multiple of kv_heads (GQA, MQA); float32, bfloat16 or float16, accumulated in fp32.
    ``causal`` masks key j from query i when j > i (top-left aligned, as Megatron's mask).
    ``sections`` are the FLASH_SECTIONS checked on this call (none: the kernels with the checks
    compiled out). What the checks find is kept in ``ledger`` (default: default_ledger(device)).
    ``faults``: at most one forward (scores, context) and one backward fault to land in the
    kernels (megatron_abft.flash.faults). On CUDA tensors the kernels are compiled by Triton; on
    CPU tensors they run in Triton's interpreter, slowly: for tests and small shapes."""
    check_inputs(q, k, v)
    if not (math.isfinite(threshold_scale) and threshold_scale > 0):
        raise ValueError(f"flash_attention: threshold_scale {threshold_scale!r} must be > 0")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    ledger = ledger if ledger is not None else default_ledger(q.device)
    inject = {True: None, False: None}
    for fault in faults:
        forward = fault.section in FORWARD
        if inject[forward] is not None:
            raise ValueError(
                "flash_attention lands at most one forward and one backward fault a call"
            )
        inject[forward], _ = kernel_args(
            fault, q.shape[0] * q.shape[1], q.shape[2], k.shape[2], q.shape[3], q.device
        )
    tol = launch.TILE_C[q.dtype] * threshold_scale * 2.0**-24
    return _FlashAttention.apply(
        q,
        k,
        v,
        *ledger.tensors,
        inject[True],
        inject[False],
        bool(causal),
        float(scale),
        due_mask(sections),
        tol,
        float(near_inf),
    )
