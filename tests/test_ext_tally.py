"""The compiled tally (megatron_abft::tally): what a guard adds to its counters and event log
from a check's per-matrix results, in one op, against the guard's PyTorch twin."""

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from test_ext import PROPERTY, needs_cuda, needs_ext
from test_ext_correct import case

from megatron_abft import _ext
from megatron_abft.config import ABFTConfig
from megatron_abft.eec import KINDS, OUTCOMES, EECResult, GemmOperands
from megatron_abft.faults import TensorFault, inject_
from megatron_abft.guard import SectionGuard


def results(batch: tuple[int, ...], seed: int, dtype=torch.float32, statuses=3) -> EECResult:
    """Per-matrix results as a check returns them, drawn at random (status below ``statuses``)."""
    g = torch.Generator().manual_seed(seed)
    status = torch.randint(0, statuses, batch, generator=g).to(torch.int8)
    kind = torch.randint(0, len(KINDS), batch, generator=g).to(torch.int8)
    row, col = torch.randint(-1, 500, (2, *batch), generator=g)
    magnitude = torch.randn(batch, generator=g, dtype=dtype).exp()
    magnitude[torch.rand(batch, generator=g) < 0.1] = float("nan")
    return EECResult(status, kind, row, col, magnitude)


def tallied(found: EECResult, step: int, kernels: bool, times: int = 2):
    """A guard's counters, and its last failed flag and event, after tallying ``found`` ``times``
    times, with the kernels or with the PyTorch twin."""
    guard = SectionGuard("scores", ABFTConfig(on_uncorrectable="log"), 0)
    guard.step = step
    guard.counts = torch.zeros(len(OUTCOMES), len(KINDS), dtype=torch.int64)
    for _ in range(times):
        if kernels:
            failed, event = guard._tally(found)
        else:
            with _ext.disabled():
                failed, event = guard._tally(found)
    return guard.counts, failed, event


@needs_ext
@PROPERTY
@given(
    batch=st.lists(st.integers(1, 40), min_size=1, max_size=3).map(tuple),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    statuses=st.integers(1, 3),
    step=st.integers(0, 10**6),
)
@example((1,), 0, torch.float32, 1, 0)  # one clean matrix
@example((300,), 1, torch.float64, 3, 7)  # more matrices than one thread block of the CUDA op
def test_tally_equals_the_pytorch_twin(batch, seed, dtype, statuses, step):
    found = results(batch, seed, dtype, statuses)
    counts, failed, event = tallied(found, step, kernels=True)
    want_counts, want_failed, want_event = tallied(found, step, kernels=False)
    assert torch.equal(counts, want_counts)
    assert failed.dtype == torch.bool and failed.shape == () and bool(failed) == bool(want_failed)
    torch.testing.assert_close(event, want_event, equal_nan=True, rtol=0, atol=0)


@needs_ext
def test_tally_counts_by_outcome_and_kind_and_picks_the_first_worst_matrix():
    status = torch.tensor([0, 1, 2, 1, 2, 0], dtype=torch.int8)
    kind = torch.tensor([0, 3, 1, 3, 2, 0], dtype=torch.int8)
    row, col = torch.arange(6) * 10, torch.arange(6) * 100
    magnitude = torch.tensor([0.0, 1.5, 2.5, 3.5, 4.5, 0.0])
    counts = torch.ones(3, len(KINDS), dtype=torch.int64)  # added to, not overwritten
    failed, event = _ext.tally((status, kind, row, col, magnitude), counts, 9)
    want = torch.ones(3, len(KINDS), dtype=torch.int64)
    want[0] += torch.tensor([0, 1, 1, 2])  # detected: every matrix not clean, by kind
    want[1] += torch.tensor([0, 0, 0, 2])  # corrected
    want[2] += torch.tensor([0, 1, 1, 0])  # uncorrectable
    assert torch.equal(counts, want) and bool(failed)
    assert event.tolist() == [9.0, 2.0, 2.0, 1.0, 20.0, 200.0, 2.5]
    failed, event = _ext.tally((status[:2], kind[:2], row[:2], col[:2], magnitude[:2]), counts, 3)
    assert not bool(failed) and event.tolist() == [3.0, 1.0, 1.0, 3.0, 10.0, 100.0, 1.5]


@needs_ext
def test_tally_opcheck():
    found = results((3, 5), seed=4)
    counts = torch.zeros(3, len(KINDS), dtype=torch.int64)
    torch.library.opcheck(torch.ops.megatron_abft.tally.default, (*found.fields, counts, 5.0))


@needs_ext
@pytest.mark.parametrize(
    "change,message",
    [
        ({"status": torch.zeros(6, dtype=torch.int64)}, "status .* want 6 Char"),
        ({"kind": torch.zeros(5, dtype=torch.int8)}, "kind .* want 6 Char"),
        ({"row": torch.zeros(6, dtype=torch.int32)}, "row .* want 6 Long"),
        ({"magnitude": torch.zeros(6, dtype=torch.float16)}, "magnitude .* want 6 float or double"),
        ({"counts": torch.zeros(2, len(KINDS), dtype=torch.int64)}, "counts .* want a contiguous"),
        ({"counts": torch.zeros(3, len(KINDS))}, "counts .* want a contiguous int64"),
    ],
)
def test_tally_bad_inputs_raise_clear_errors(change, message):
    found = dict(
        zip(("status", "kind", "row", "col", "magnitude"), results((6,), 2).fields, strict=True)
    )
    args = found | {"counts": torch.zeros(3, len(KINDS), dtype=torch.int64)} | change
    with pytest.raises(RuntimeError, match=message):
        torch.ops.megatron_abft.tally(*args.values(), 1.0)
    empty = [t[:0] for t in found.values()]
    with pytest.raises(RuntimeError, match="tally: no matrices"):
        torch.ops.megatron_abft.tally(*empty, args["counts"], 1.0)


def _guard_check(c, operands, kernels: bool):
    """A scores guard's check of ``c``: its counters, events and pending flag, and the number
    of top-level ops the check launched (torch.profiler)."""
    guard = SectionGuard("scores", ABFTConfig(on_uncorrectable="log"), 0)
    guard.step = 4
    c = c.clone()
    guard.check(c.clone(), operands)  # the counters are allocated on the first check
    guard.pending, guard.events = None, []  # as at the start of a step (guard.set_step)
    guard.counts.zero_()
    cpu = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=cpu, acc_events=True) as profile:
        if kernels:
            guard.check(c, operands)
        else:
            with _ext.disabled():
                guard.check(c, operands)
    ops = sum(1 for e in profile.events() if e.cpu_parent is None and "::" in e.name)
    return guard, c, ops


@needs_ext
@pytest.mark.parametrize("batch", [(2, 4), ()], ids=["batched", "one matrix"])
def test_a_guard_s_check_with_the_kernels_is_a_few_ops_and_counts_as_the_pytorch_path(batch):
    """A clean check is encode, verify and a host read of the worst status (on a GPU with
    sync_free there is no read and the tally runs instead); a corrected one adds the tally.
    One matrix (a linear layer's GEMM) costs no more ops than a batch. Counters, events and the
    pending flag equal the PyTorch path's."""
    c, refs, operands = case(torch.bfloat16, batch, 128, 96, 32, False, ("col", "row"), seed=5)
    _, _, clean_ops = _guard_check(c, operands, kernels=True)
    inject_(c, TensorFault("nan", "0d", batch_index=3 if batch else None, seed=5))
    if batch:
        inject_(c, TensorFault("value", "row", value=1e3, batch_index=6, seed=5))
    guard, fixed, ops = _guard_check(c, operands, kernels=True)
    reference, want, _ = _guard_check(c, operands, kernels=False)
    assert clean_ops <= 7 and ops <= clean_ops + 1, (clean_ops, ops)
    assert torch.equal(guard.counts, reference.counts)
    assert int(guard.counts[1].sum()) == (2 if batch else 1)
    assert not bool(guard.pending) and not bool(reference.pending)
    torch.testing.assert_close(
        guard.events[-1], reference.events[-1], rtol=1e-6, atol=0, equal_nan=True
    )
    torch.testing.assert_close(fixed, want, rtol=0.01, atol=1e-3)


@needs_cuda
@pytest.mark.parametrize("batch", [(1,), (3, 7), (700,)])
def test_cuda_tally_equals_the_cpu_op(batch):
    found = results(batch, seed=len(batch), dtype=torch.float64)
    found.status.reshape(-1)[-1] = 2  # ties: the first uncorrectable matrix is the worst
    cpu_counts = torch.zeros(3, len(KINDS), dtype=torch.int64)
    cpu = _ext.tally(found.fields, cpu_counts, 11)
    gpu_counts = torch.ones(3, len(KINDS), dtype=torch.int64, device="cuda")  # added to
    gpu = _ext.tally(tuple(t.cuda() for t in found.fields), gpu_counts, 11)
    assert torch.equal(gpu_counts.cpu() - 1, cpu_counts)
    assert bool(gpu[0]) == bool(cpu[0])
    torch.testing.assert_close(gpu[1].cpu(), cpu[1], equal_nan=True, rtol=0, atol=0)
    args = (*(t.cuda() for t in found.fields), gpu_counts, 11.0)
    torch.library.opcheck(torch.ops.megatron_abft.tally.default, args)


@needs_ext
def test_the_kernel_selftest_checks_the_tally(monkeypatch):
    from megatron_abft.kernel_selftest import mismatches

    assert mismatches(torch.device("cpu")) == []
    real = torch.ops.megatron_abft.tally

    def counts_nothing(status, kind, row, col, magnitude, counts, step):
        return real(status, kind, row, col, magnitude, counts.clone(), step)

    monkeypatch.setattr(torch.ops.megatron_abft, "tally", counts_nothing)
    assert mismatches(torch.device("cpu")) == ["tally"]


@needs_cuda
def test_a_sync_free_check_on_the_gpu_reads_nothing_and_launches_what_the_model_counts():
    """The path the overhead model costs for a GPU: with the kernels, a clean sync-free check
    launches the kernels scaling.CHECK_KERNELS counts, and a clean check and a faulty one never
    synchronise with the host (torch.cuda's sync debug mode raises on any synchronising call)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "tools"))
    from bench_overhead import check_launches

    from megatron_abft.scaling import CHECK_KERNELS

    launches = check_launches(torch.device("cuda"))
    assert launches == CHECK_KERNELS["kernels"], f"a clean check launched {launches} kernels"
    c, refs, operands = case(torch.bfloat16, (2, 4), 128, 96, 32, False, ("col", "row"), seed=5)
    gpu = GemmOperands(operands.a.cuda(), operands.b.cuda(), operands.alpha)
    faulty = c.cuda()
    faulty[1, 2, 5, 7] = float("nan")
    guard = SectionGuard("scores", ABFTConfig(sync_free=True, on_uncorrectable="log"), 0)
    guard.check(c.cuda(), gpu)  # the counters, the self-test and the caches, outside the mode
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        guard.check(faulty, gpu)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert int(guard.counts[1].sum()) == 1 and not bool(guard.pending)
    assert not faulty.isnan().any()
