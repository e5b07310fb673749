"""The protected flash attention under CUDA graph capture, as Megatron's CUDA graphs would run it:
a forward and backward captured once and replayed on new inputs, copied into the captured ones,
give eager's output and gradients bit for bit, and the ledger on the device counts what each
replay's checks find, as an eager call's counts. GPU only (``ABFT_FLASH_DEVICE=cuda``,
tools/gpu_check.sh): the interpreter has no graphs."""

import pytest
import torch
from flash_cases import DEVICE, inputs, outputs

from megatron_abft.flash import FlashLedger, flash_attention

pytestmark = pytest.mark.skipif(
    DEVICE.type != "cuda", reason="CUDA graphs need a GPU (ABFT_FLASH_DEVICE=cuda)"
)


def captured(q, k, v, do, **options):
    """A CUDA graph of one forward and backward on static copies of the inputs: (the graph, the
    static inputs q, k, v, do, the static output and gradients)."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    grad = do.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: the kernels compile, the allocator settles
        for _ in range(2):
            flash_attention(*leaves, **options).backward(grad)
            for x in leaves:
                x.grad = None
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attention(*leaves, **options)
        out.backward(grad)
    return graph, (*leaves, grad), (out, *(x.grad for x in leaves))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_replay_equals_eager_on_new_inputs(dtype):
    q, k, v, do = inputs(2, 4, 2, 256, 64, dtype, seed=1)
    ledger = FlashLedger.on(DEVICE)
    graph, static, results = captured(q, k, v, do, ledger=ledger)
    for seed in (2, 3):
        fresh = inputs(2, 4, 2, 256, 64, dtype, seed=seed)
        with torch.no_grad():
            for target, value in zip(static, fresh, strict=True):
                target.copy_(value)
        graph.replay()
        want = outputs(lambda a, b, c: flash_attention(a, b, c, ledger=ledger), *fresh)
        assert all(torch.equal(g, w) for g, w in zip(results, want, strict=True))
    assert ledger.counts.sum() == 0


def test_each_replay_counts_its_findings_on_the_device():
    """A bound so tight that every check flags (and flags again: uncorrectable): each replay
    adds to the ledger what an eager call adds, with no host read between."""
    q, k, v, do = inputs(1, 2, 2, 192, 64, torch.bfloat16, seed=4)
    options = dict(threshold_scale=1e-30)
    eager = FlashLedger.on(DEVICE)
    outputs(lambda a, b, c: flash_attention(a, b, c, ledger=eager, **options), q, k, v, do)
    assert eager.counts.sum() > 0
    ledger = FlashLedger.on(DEVICE)
    graph, _, _ = captured(q, k, v, do, ledger=ledger, **options)
    ledger.counts.zero_()
    ledger.logged.zero_()
    graph.replay()
    graph.replay()
    assert torch.equal(ledger.counts, 2 * eager.counts)
    assert torch.equal(ledger.logged, 2 * eager.logged)
