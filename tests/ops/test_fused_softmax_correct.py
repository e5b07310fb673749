"""softmax_correct_tally (csrc/bindings/abft_softmax.cpp): the fused softmax that also corrects the
scores it screens, redoes P from them and tallies the outcome into a guard's ledger, with no host
read (the GPU's sync-free check of the scores). Against its composition from softmax_check,
verify_correct and tally, and against the clean softmax; in the protected attention through
its sync-free path, on CPU always, on CUDA where a GPU is present."""

import pytest
import torch
from cuda_targets import TARGETS
from test_fused_softmax import (
    DEVICES,
    NO_SCREEN,
    assert_close_to_sums,
    faulty_scores,
    masks,
    megatron_softmax,
    needs_cuda,
    pass_sizes,
    scores_case,
)

from megatron_abft.check.eec import CORRECTED, KINDS
from megatron_abft.check.ledger import Ledger
from megatron_abft.ops import compiled

pytestmark = pytest.mark.skipif(not compiled.available(), reason=compiled.backend())
ALPHA = 0.25  # scores_case's


def corrected(s, sides, q, k, mask, causal, vectors, device, capacity=40):
    """softmax_correct_tally of a copy of ``s``: the scores after it, its outputs and the
    ledger it tallied into (from step 3)."""
    s = s.clone()
    ledger = Ledger.on(torch.device(device), 3)
    out = compiled.softmax_correct_tally(
        s, sides, mask, causal, 1.0, 16, vectors, (q, k.mT, ALPHA), 1e10, capacity, ledger
    )
    return s, out, ledger


def composed(s, sides, q, k, mask, causal, vectors, device, capacity=40):
    """What softmax_correct_tally stands for: verify_correct of S, softmax_check of the S it
    leaves, and the tally of what verify_correct found."""
    s = s.clone()
    found = compiled.verify_correct(s, sides, (q, k.mT, ALPHA, None), 1e10, capacity)
    out = compiled.softmax_check(s, NO_SCREEN, mask, causal, 1.0, 16, vectors)
    ledger = Ledger.on(torch.device(device), 3)
    failed = compiled.tally(found, ledger)
    return s, (out[0], failed, *out[2:]), ledger, found


def tolerance(dtype):
    return {
        torch.float64: {"rtol": 1e-12, "atol": 1e-12},
        torch.float32: {"rtol": 1e-5, "atol": 1e-6},
    }.get(dtype, {"rtol": 2e-2, "atol": 2e-2})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("mask_kind", ["causal", "padding"])
@pytest.mark.parametrize("with_pass", [True, False], ids=["P's pass", "P alone"])
def test_it_is_verify_correct_then_the_softmax_then_tally(device, dtype, mask_kind, with_pass):
    """Four matrices with a fault (a large value, an INF, a NaN, a shifted row): S corrected as
    verify_correct corrects it, P as softmax_check gives it from that S and equal to the clean
    scores' softmax, P's pass the operand_pass of the P written (on a GPU the two Ps may differ
    by rounding), and the ledger as tally fills it, failed included."""
    batch, sq, hn = (3, 2), 40, 8
    q, k, s, sides = scores_case(batch, sq, sq, hn, dtype, device, seed=2)
    mask, causal, full = masks(mask_kind, batch, sq, sq, device)
    v = torch.randn(*batch, sq, 16, generator=torch.Generator().manual_seed(3)).to(dtype)
    vectors = compiled.pair_vectors(s, v.to(device), 16) if with_pass else None
    bad = faulty_scores(s, seed=1)
    got_s, got, ledger = corrected(bad, sides, q, k, mask, causal, vectors, device)
    want_s, want, want_ledger, found = composed(bad, sides, q, k, mask, causal, vectors, device)
    assert int((found[0] == CORRECTED).sum()) == 4
    torch.testing.assert_close(got_s, want_s, **tolerance(dtype))
    torch.testing.assert_close(got[0], want[0], **tolerance(dtype))
    torch.testing.assert_close(got[0], megatron_softmax(s, full, 1.0), **tolerance(dtype))
    assert got[1].dtype == torch.bool and got[1].shape == () and not bool(got[1])
    if with_pass:  # the pass over the P it wrote: P itself may differ from want's by rounding
        direct = torch.ops.megatron_abft.operand_pass(got[0], 16, *vectors, 1.0)
        sizes = pass_sizes(direct, got[0], vectors[0])
        for g, w, size in zip(got[2:], direct, sizes, strict=True):
            assert_close_to_sums(g, w, size, dtype)
    else:
        assert all(t.numel() == 0 for t in got[2:])
    assert torch.equal(ledger.counts, want_ledger.counts)
    assert int(ledger.counts[1].sum()) == 4 and int(ledger.logged) == 1
    torch.testing.assert_close(ledger.log[0, :6], want_ledger.log[0, :6], rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_a_clean_s_is_left_alone_and_an_unsettled_one_fails(device):
    """Clean scores: S, P and P's pass as softmax_check gives them and nothing tallied. A block
    of NaN beyond the correction's capacity: S put back bit for bit, P from it, counted
    uncorrectable and failed."""
    batch, sq = (2, 2), 36
    q, k, s, sides = scores_case(batch, sq, sq, 8, torch.float32, device, seed=4)
    v = torch.randn(*batch, sq, 16, device=device)
    vectors = compiled.pair_vectors(s, v, 16)
    got_s, got, ledger = corrected(s, sides, q, k, None, True, vectors, device)
    want = compiled.softmax_check(s, sides, None, True, 1.0, 16, vectors)
    assert torch.equal(got_s, s) and not bool(got[1])
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    for g, w in zip(got[2:], want[2:], strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert not ledger.counts.any() and not ledger.logged.any()
    bad = s.clone()
    bad[1, 0, 10:20, 10:20] = float("nan")
    got_s, got, ledger = corrected(bad, sides, q, k, None, True, vectors, device, capacity=2)
    assert torch.equal(got_s.isnan(), bad.isnan())
    assert torch.equal(got_s.nan_to_num(), bad.nan_to_num())
    assert bool(got[1]) and int(ledger.counts[2, KINDS.index("nan")]) == 1
    assert got[0][1, 0].isnan().any() and not got[0][0].isnan().any()


def test_it_needs_a_screen_and_opchecks():
    q, k, s, sides = scores_case((2,), 20, 20, 8, torch.float32, "cpu")
    ledger = Ledger.on(torch.device("cpu"), 0)
    tail = (q, k.mT, ALPHA, 1e10, 20, ledger.counts, ledger.clock, ledger.log, ledger.logged)
    op = torch.ops.megatron_abft.softmax_correct_tally
    with pytest.raises(RuntimeError, match="needs the screen of S"):
        op(s.clone(), *NO_SCREEN, None, True, 1.0, 16, None, None, *tail)
    with pytest.raises(RuntimeError, match="do not produce c of shape"):
        op(s.clone(), *sides, None, True, 1.0, 16, None, None, q, k, *tail[2:])
    v = torch.randn(2, 20, 6)
    u, z = compiled.pair_vectors(s, v, 16)
    bad = s.clone()
    bad[1, 3, 4] += 100.0
    torch.library.opcheck(op.default, (bad, *sides, None, True, 1.0, 16, u, z, *tail))


@needs_cuda
def test_on_cuda_it_is_two_launches():
    """The single pass, then one thread block that corrects, redoes P and tallies."""
    q, k, s, sides = scores_case((2, 3), 64, 64, 8, torch.bfloat16, "cuda")
    v = torch.randn(2, 3, 64, 16, device="cuda").to(torch.bfloat16)
    vectors = compiled.pair_vectors(s, v, 16)
    ledger = Ledger.on(torch.device("cuda"), 3)  # made before: its zeros are launches too
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        compiled.softmax_correct_tally(
            s, sides, None, True, 1.0, 16, vectors, (q, k.mT, ALPHA), 1e10, 40, ledger
        )
        torch.cuda.synchronize()
    kernels = [e for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    names = [e.name for e in kernels]
    assert len(names) == 2, names


@pytest.mark.parametrize("gpu", TARGETS)
def test_the_cuda_kernels_equal_the_cpu_op(gpu):
    """Four faulty matrices corrected, their P and P's pass redone, as the C++ kernels do."""
    q, k, s, sides = scores_case((2, 3), 64, 64, 8, torch.bfloat16, gpu.device)
    v = torch.randn(2, 3, 64, 16, device=gpu.device).to(torch.bfloat16)
    bad = faulty_scores(s, seed=1)
    with gpu.kernels():
        vectors = compiled.pair_vectors(s, v, 16)
        gpu_s, gpu, gpu_ledger = corrected(bad, sides, q, k, None, True, vectors, gpu.device, 64)
    on_cpu = [[t.cpu() for t in side] for side in sides[2:4]]
    cpu_sides = (*sides[:2], *on_cpu, *sides[4:])
    cpu_vectors = tuple(t.cpu() for t in vectors)
    cpu_s, cpu, cpu_ledger = corrected(
        bad.cpu(), cpu_sides, q.cpu(), k.cpu(), None, True, cpu_vectors, "cpu", 64
    )  # capacity 64: the shifted row flags every column
    torch.testing.assert_close(gpu_s.cpu(), cpu_s, **tolerance(torch.bfloat16))
    torch.testing.assert_close(gpu[0].cpu(), cpu[0], **tolerance(torch.bfloat16))
    assert torch.equal(gpu_ledger.counts.cpu(), cpu_ledger.counts)
    assert int(cpu_ledger.counts[1].sum()) == 4 and not bool(gpu[1])
    sizes = pass_sizes(cpu[2:], cpu[0], cpu_vectors[0])
    for g, w, size in zip(gpu[2:], cpu[2:], sizes, strict=True):
        assert_close_to_sums(g.cpu(), w, size, torch.bfloat16)


def test_the_kernel_selftest_checks_it(monkeypatch):
    """An op that screens but corrects nothing fails the self-test, which then keeps a GPU on
    the PyTorch path."""
    from megatron_abft.ops.selftest import mismatches

    assert mismatches(torch.device("cpu")) == []
    check = torch.ops.megatron_abft.softmax_check

    def corrects_nothing(s, *args):
        p, flagged, *rest = check(s, *args[:12])
        return p, torch.zeros((), dtype=torch.bool), *rest

    monkeypatch.setattr(torch.ops.megatron_abft, "softmax_correct_tally", corrects_nothing)
    wrong = mismatches(torch.device("cpu"))
    assert wrong == [f"softmax_correct_tally ({d})" for d in (torch.float32, torch.bfloat16)]
