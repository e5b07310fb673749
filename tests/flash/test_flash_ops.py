"""flash_attention as a PyTorch op: torch.compile traces it (a custom op with a fake, inside an
autograd.Function), and its path holds no buffer of O(seq^2): every tensor it makes, forward and
backward, is watched and none is the size of the scores."""

import torch
from dispatched import Dispatched
from flash_cases import inputs, outputs
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_abft.config import FLASH_SECTIONS
from megatron_abft.flash import FlashLedger, flash_attention, launch


def test_torch_compile_traces_it_whole_and_agrees_with_eager():
    q, k, v, do = inputs(1, 2, 1, 40, 64, torch.bfloat16)
    ledger = FlashLedger.on(q.device)

    def attention(a, b, c):
        return flash_attention(a, b, c, ledger=ledger)

    torch._dynamo.reset()
    compiled = torch.compile(attention, fullgraph=True, backend="aot_eager")
    eager = outputs(attention, q, k, v, do)
    traced = outputs(compiled, q, k, v, do)
    assert all(torch.equal(a, b) for a, b in zip(traced, eager, strict=True))
    assert ledger.counts.sum() == 0


class _Sizes(TorchDispatchMode):
    """The element count of every tensor an op makes while it is active."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.sizes.append((t.numel(), str(func)))
        return out


def test_no_tensor_on_its_path_is_the_size_of_the_scores():
    """The ops' bodies, forward and backward, at 384 tokens, watched op by op: the largest
    tensor they make is the size of q (the outputs; the checksum vectors and Delta are
    smaller), far from the 147,456 elements of one head's scores; the kernels themselves work
    tile by tile in registers and shared memory."""
    seq, dim = 384, 64
    q, k, v, do = inputs(1, 1, 1, seq, dim, torch.bfloat16)
    tol = launch.TILE_C[q.dtype] * 2.0**-24
    checks = launch.Checks((1 << len(FLASH_SECTIONS)) - 1, tol, 1e10)
    ledger = FlashLedger.on(q.device)
    with _Sizes() as watched:
        for run in ("forward", "backward"):
            found = launch.Findings.empty(1, q.device)
            if run == "forward":
                o, lse = launch.forward(q, k, v, True, dim**-0.5, checks, found, ledger.tensors)
            else:
                launch.backward(do, q, k, v, o, lse, True, dim**-0.5, checks, found, ledger.tensors)
    largest, op = max(watched.sizes)
    assert largest <= 2 * seq * dim < seq * seq, (largest, op)
    ops = {op for _, op in watched.sizes}
    assert {"aten.empty_like.default", "aten.empty.memory_format", "aten.zeros.default"} <= ops
    assert ledger.counts.sum() == 0


def test_a_dispatch_mode_sees_the_custom_ops_and_eager_equals_them():
    """Eager calls run the ops' bodies directly (no dispatcher hops); a dispatch mode (a FLOP
    counter, a tracer) sees the calls as the custom ops, with the same results."""
    q, k, v, do = inputs(1, 2, 1, 40, 64, torch.bfloat16)
    ledger = FlashLedger.on(q.device)

    def attention(a, b, c):
        return flash_attention(a, b, c, ledger=ledger)

    eager = outputs(attention, q, k, v, do)
    with Dispatched() as watched:
        seen = outputs(attention, q, k, v, do)
    assert "megatron_abft.flash_forward.default" in watched.ops
    assert "megatron_abft.flash_backward.default" in watched.ops
    assert all(torch.equal(a, b) for a, b in zip(seen, eager, strict=True))
    assert ledger.counts.sum() == 0
