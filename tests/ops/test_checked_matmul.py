"""The checked GEMM over a batch of matrices (megatron_abft.ops.checked_gemm.checked_matmul), in
Triton's interpreter: the unfused attention's scores ``alpha Q K^T`` and context ``P V`` with
their operands laid out as Megatron holds them (``[s, b, heads, d]``, keys and values shared by
a group of heads), equal to the float64 products; a fault in one matrix is flagged on that
matrix's tile only and corrected or reported, and the tally names the matrix."""

import pytest
import torch
from dispatched import Dispatched

from megatron_abft.check.ledger import Ledger
from megatron_abft.config import KINDS
from megatron_abft.ops.checked_gemm import (
    INTERPRETED,
    checked_matmul,
    tally,
    weight_sums,
)

CORRECTED, UNCORRECTABLE = 1, 2
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
B, HEADS, GROUPS = 2, 4, 2  # two query heads a key and value head


def seq_major(s, d, groups=HEADS, dtype=torch.float32, seed=0):
    """A ``[s, B, groups, d]`` tensor (Megatron's layout) and its ``[B, groups, s, d]`` view."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(s, B, groups, d, generator=g).to(dtype)
    return t, t.permute(1, 2, 0, 3)


def grouped(t):
    """``[B, GROUPS, ...]`` repeated to ``[B, HEADS, ...]`` as the heads read it."""
    return t.repeat_interleave(HEADS // GROUPS, dim=1)


def test_the_scores_are_alpha_q_k_transposed_per_head_with_shared_keys():
    _, q = seq_major(70, 48)
    _, k = seq_major(50, 48, GROUPS, seed=1)
    alpha = 48**-0.5
    y, codes = checked_matmul(q, k, alpha=alpha)
    want = alpha * q.double() @ grouped(k).double().mT
    assert y.shape == (B, HEADS, 70, 50) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    assert codes.shape == (B, HEADS, 3 * 2) and codes.eq(0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_context_is_written_into_megatrons_layout(dtype):
    g = torch.Generator().manual_seed(2)
    p = torch.rand(B, HEADS, 40, 70, generator=g).to(dtype)
    _, v = seq_major(70, 24, GROUPS, dtype, seed=3)
    out = torch.full((40, B, HEADS, 24), float("nan"), dtype=dtype)
    y, codes = checked_matmul(p, v.mT, out=out.permute(1, 2, 0, 3))
    want = (p.double() @ grouped(v).double()).permute(2, 0, 1, 3)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
    assert y.data_ptr() == out.data_ptr() and codes.eq(0).all()


@pytest.mark.parametrize("value, kind", [(float("nan"), "nan"), (60.0, "finite")])
@pytest.mark.parametrize("persistent", [False, True])
def test_a_fault_in_one_matrix_is_found_on_its_tile_and_named(value, kind, persistent):
    _, q = seq_major(64, 32)
    _, k = seq_major(64, 32, GROUPS, seed=1)
    clean, _ = checked_matmul(q, k, alpha=0.5)
    matrix, row, col = 5, 40, 33  # sample 1, head 1; tile (1, 1) of 2 x 2
    y, codes = checked_matmul(q, k, alpha=0.5, fault=(matrix, row, col, value, persistent))
    outcome = UNCORRECTABLE if persistent else CORRECTED
    want = torch.zeros(B * HEADS, 4, dtype=torch.int32)
    want[matrix, 3] = outcome << 2 | KINDS.index(kind)
    assert torch.equal(codes.view(B * HEADS, 4), want)
    if persistent:  # the fault stays, reported (scaled as the output is)
        assert not torch.equal(y[1, 1, row, col], clean[1, 1, row, col])
        y[1, 1, row, col] = clean[1, 1, row, col]
    torch.testing.assert_close(y, clean, rtol=0, atol=0)
    ledger = Ledger.on(torch.device("cpu"), step=0)
    assert bool(tally(codes, 64, INTERPRETED, ledger)) is persistent
    assert int(ledger.counts[0].sum()) == 1 and int(ledger.logged) == 1
    # the matrix (sample 1, head 1), the kind and the tile's origin in its matrix
    assert ledger.log[0, 1:6].tolist() == [outcome, matrix, KINDS.index(kind), 32.0, 32.0]


def test_a_fault_below_the_bound_of_its_row_is_not_flagged_and_one_above_is():
    _, q = seq_major(32, 32)
    _, k = seq_major(32, 32, GROUPS, seed=1)
    clean, _ = checked_matmul(q, k)
    sums = weight_sums(k, INTERPRETED.block_n).double()  # [B, GROUPS, 1, 2, 32]
    mass = q[0, 3, 7].double().abs() @ sums[0, 1, 0, 1]  # head 3 reads group 1
    g = 2 * (32 + INTERPRETED.block_n + 2) * 2.0**-24
    for factor, flagged in ((2.0, True), (0.25, False)):
        value = clean[0, 3, 7, 9].item() + factor * g * mass.item()
        _, codes = checked_matmul(q, k, fault=(3, 7, 9, value, True))
        assert bool(codes.view(-1)[3]) is flagged and int(codes.count_nonzero()) == int(flagged)


def test_batched_weight_sums_are_each_matrixs_own():
    _, k = seq_major(70, 40, GROUPS, torch.bfloat16, seed=4)
    sums = weight_sums(k, 32)
    assert sums.shape == (B, GROUPS, 3, 2, 40)
    for b in range(B):
        for g in range(GROUPS):
            assert torch.equal(sums[b, g], weight_sums(k[b, g].contiguous(), 32))


def test_bad_operands_are_refused_with_what_was_given():
    _, q = seq_major(8, 16)
    _, k = seq_major(8, 16, 3)
    with pytest.raises(ValueError, match="not a multiple"):
        checked_matmul(q, k)
    with pytest.raises(ValueError, match="do not multiply"):
        checked_matmul(q, k[..., :8])
    with pytest.raises(ValueError, match="out"):
        checked_matmul(q, q, out=torch.empty(B, HEADS, 8, 9))
    with pytest.raises(ValueError, match="sums"):
        checked_matmul(q, q, sums=weight_sums(q[:, :2], INTERPRETED.block_n))


@pytest.mark.parametrize(
    "device, dtype",
    [("cpu", torch.float32), pytest.param("cuda", torch.bfloat16, marks=cuda)],
)
def test_the_attentions_autograd_functions_keep_megatrons_gradients(device, dtype):
    """layers.checked_attention: scores and context by the checked GEMM, keys and values per KV
    group; gradients equal those of Megatron's repeat_interleave, baddbmm and bmm."""
    from megatron_abft.config import ABFTConfig
    from megatron_abft.layers import checked_attention
    from megatron_abft.runtime.guard import SectionGuard

    config = ABFTConfig()
    guards = [SectionGuard(s, config, 0) for s in ("scores", "context")]
    q, k, v = (seq_major(48, 32, h, seed=i)[0].to(device, dtype) for i, h in
               enumerate((HEADS, GROUPS, GROUPS)))  # fmt: skip
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    s = checked_attention.scores(leaves[0], leaves[1], 0.2, guards[0], config)
    out = checked_attention.context(s.softmax(-1), leaves[2], guards[1], config)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(6)).to(device, dtype)
    with Dispatched() as backward:
        out.backward(grad)
    # the tiles' codes have no gradient: none is made for them
    assert not [op for op in backward.ops if "zeros" in op], backward.ops
    ref = [t.detach().requires_grad_() for t in (q, k, v)]
    kr, vr = (t.repeat_interleave(HEADS // GROUPS, dim=2) for t in ref[1:])
    q3, k3, v3 = (t.reshape(48, B * HEADS, 32).transpose(0, 1) for t in (ref[0], kr, vr))
    p = torch.baddbmm(q3.new_empty(()), q3, k3.mT, beta=0.0, alpha=0.2).softmax(-1)
    want = torch.bmm(p, v3).view(B, HEADS, 48, 32).permute(2, 0, 1, 3).reshape(48, B, -1)
    want.backward(grad)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(out, want, **tol)
    for got, expect in zip(leaves, ref, strict=True):
        torch.testing.assert_close(got.grad, expect.grad, **tol)
    assert all(int(g.counts.sum()) == 0 and g.pending is not None for g in guards)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_on_cuda_gpt3_350ms_attention_gemms_equal_megatrons_without_a_false_alarm(dtype):
    """GPT-3 350M's heads (64 wide) at sequence 2048, two samples: 16 x 16 tiles a matrix."""
    b, heads, s, d = 2, 16, 2048, 64
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(s, b, heads, d, generator=g).to("cuda", dtype) for _ in range(3))
    scores, codes = checked_matmul(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), alpha=d**-0.5)
    q3, k3, v3 = (t.reshape(s, b * heads, d).transpose(0, 1) for t in (q, k, v))
    want = torch.baddbmm(q3.new_empty(()), q3, k3.mT, beta=0.0, alpha=d**-0.5)
    torch.testing.assert_close(scores.view(b * heads, s, s), want, rtol=2e-2, atol=2e-2)
    assert codes.shape == (b, heads, 256) and int(codes.count_nonzero()) == 0
    p = scores.float().softmax(-1).to(dtype)
    context, codes = checked_matmul(p, v.permute(1, 2, 3, 0))
    want = torch.bmm(p.view(b * heads, s, s), v3).view(b, heads, s, d)
    torch.testing.assert_close(context, want, rtol=2e-2, atol=2e-2)
    assert int(codes.count_nonzero()) == 0


@cuda
@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e20, 40.0])
@pytest.mark.parametrize("persistent", [False, True])
def test_on_cuda_a_fault_in_one_head_is_corrected_or_reported(value, persistent):
    _, q = seq_major(300, 64)
    _, k = seq_major(300, 64, GROUPS, seed=1)
    q, k = q.to("cuda", torch.bfloat16), k.to("cuda", torch.bfloat16)
    clean, _ = checked_matmul(q, k, alpha=0.125)
    y, codes = checked_matmul(q, k, alpha=0.125, fault=(6, 200, 150, value, persistent))
    flagged = codes.view(-1).nonzero().flatten().tolist()
    assert len(flagged) == 1 and flagged[0] // codes.shape[-1] == 6
    assert int(codes.view(-1)[flagged[0]]) >> 2 == (UNCORRECTABLE if persistent else CORRECTED)
    if persistent:
        y[1, 2, 200, 150] = clean[1, 2, 200, 150]
    assert torch.equal(y, clean)
