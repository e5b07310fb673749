"""The compiled tally (megatron_abft::tally): what a guard adds to its counters and event log
from a check's per-matrix results, in one op, against the guard's PyTorch twin; and
verify_correct_tally, the check and its tally in one op."""

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from test_ext import PROPERTY, needs_cuda, needs_ext
from test_ext_correct import _sides, bits, case, recompute_tolerance

from megatron_abft import _ext
from megatron_abft.checksum import encode
from megatron_abft.config import ABFTConfig
from megatron_abft.eec import (
    CORRECTED,
    KINDS,
    OUTCOMES,
    EECResult,
    GemmOperands,
    _kernel_check,
    verify_and_correct,
)
from megatron_abft.faults import TensorFault, inject_
from megatron_abft.guard import SectionGuard
from megatron_abft.sides import Check
from megatron_abft.tolerance import gemm_rounding


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


@needs_cuda
def test_a_sync_free_check_captured_in_a_cuda_graph_corrects_and_counts_on_every_replay():
    """Sync-free checks are capturable: a guard's check captured once in a CUDA graph finds,
    corrects and counts a fault landed before each replay (the counters live on the device; the
    event list, kept on the host, gets the capture's one record)."""
    c, refs, operands = case(torch.float32, (2, 4), 128, 96, 32, False, ("col", "row"), seed=6)
    gpu = GemmOperands(operands.a.cuda(), operands.b.cuda(), operands.alpha)
    clean = c.cuda()
    static = clean.clone()
    guard = SectionGuard("scores", ABFTConfig(sync_free=True, on_uncorrectable="log"), 0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # the counters, the self-test and the caches, before capture
        guard.check(static, gpu)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        guard.check(static, gpu)
    torch.cuda.synchronize()
    before = guard.counts.clone()
    for replay in range(3):
        static.copy_(clean)
        static[1, replay, 5 + replay, 7] += 1e3
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(static, clean, **recompute_tolerance(torch.float32))
    corrected = guard.counts[1] - before[1]
    assert int(corrected.sum()) == 3 and int((guard.counts[2] - before[2]).sum()) == 0


def checked(c, refs, operands, tally=None):
    """The kernels' check of ``c`` in place, alone or with ``tally`` (counts, step)."""
    check = Check(gemm_rounding(c.dtype, c.device), 1.0, 1e10, max(c.shape[-2:]), operands)
    return _kernel_check(c, refs, check, tally)


def faulty_case(dtype, seed, kind, pattern, device="cpu"):
    """A batch of 6 GEMM outputs (with a bias) and their references on ``device``; one matrix
    with a fault of ``kind`` and ``pattern`` ("none": clean)."""
    c, refs, operands = case(dtype, (2, 3), 40, 24, 16, True, ("col", "row"), seed)
    if kind != "none":
        inject_(c, TensorFault(kind, pattern, value=1e4, batch_index=seed % 6, seed=seed))
    if device != "cpu":
        a, b, bias = (t.to(device) for t in (operands.a, operands.b, operands.bias))
        col, row = encode(a, b, alpha=0.5, bias=bias, block=16)
        refs, operands = {"col": col, "row": row}, GemmOperands(a, b, 0.5, bias)
    return c.to(device), refs, operands


@needs_ext
@PROPERTY
@given(
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    kind=st.sampled_from(["nan", "inf", "value", "none"]),
    pattern=st.sampled_from(["0d", "row", "col", "2d"]),
    seed=st.integers(0, 2**16),
    step=st.integers(0, 10**6),
)
def test_verify_correct_tally_is_verify_correct_then_tally(dtype, kind, pattern, seed, step):
    c, refs, operands = faulty_case(dtype, seed, kind, pattern)
    alone, fused = c.clone(), c.clone()
    found = checked(alone, refs, operands)
    want_counts = torch.ones(3, len(KINDS), dtype=torch.int64)  # added to, not overwritten
    want_failed, want_event = _ext.tally(found, want_counts, step)
    counts = torch.ones(3, len(KINDS), dtype=torch.int64)
    *got, failed, event = checked(fused, refs, operands, (counts, step))
    for g, w in zip(got, found, strict=True):
        assert torch.equal(bits(g), bits(w))
    assert torch.equal(bits(fused), bits(alone))
    assert torch.equal(counts, want_counts) and bool(failed) == bool(want_failed)
    torch.testing.assert_close(event, want_event, equal_nan=True, rtol=0, atol=0)


@needs_ext
def test_verify_correct_tally_opcheck_and_its_place_in_a_check():
    """opcheck on the op; in verify_and_correct it tallies only a sync-free check off the CPU
    (on a CPU, and with sync_free=False, the PyTorch path may still change what was found, so
    the caller tallies)."""
    c, refs, operands = faulty_case(torch.float32, 3, "value", "0d")
    counts = torch.zeros(3, len(KINDS), dtype=torch.int64)
    args = (c.clone(), *_sides(c, refs, operands), operands.a, operands.b, 0.5, operands.bias)
    torch.library.opcheck(
        torch.ops.megatron_abft.verify_correct_tally.default, (*args, 1e10, 40, counts, 2.0)
    )
    counts.zero_()
    result = verify_and_correct(c, **refs, operands=operands, tally=(counts, 2), sync_free=True)
    assert result.tallied is None and not counts.any()
    assert int((result.status == CORRECTED).sum()) == 1


@needs_cuda
def test_cuda_verify_correct_tally_equals_the_cpu_op():
    """In one launch on CUDA: the correction, then the tally of what it found."""
    cpu_c, cpu_refs, cpu_operands = faulty_case(torch.bfloat16, 4, "nan", "row")
    gpu_c, gpu_refs, gpu_operands = faulty_case(torch.bfloat16, 4, "nan", "row", "cuda")
    counts = [torch.zeros(3, len(KINDS), dtype=torch.int64, device=d) for d in ("cpu", "cuda")]
    cpu = checked(cpu_c, cpu_refs, cpu_operands, (counts[0], 9))
    gpu = checked(gpu_c, gpu_refs, gpu_operands, (counts[1], 9))
    for got, want in zip(gpu[:2], cpu[:2], strict=True):
        assert torch.equal(got.cpu(), want)
    torch.testing.assert_close(
        gpu_c.cpu(), cpu_c, equal_nan=True, **recompute_tolerance(torch.bfloat16)
    )
    assert torch.equal(counts[1].cpu(), counts[0]) and int(counts[0][1].sum()) == 1
    assert bool(gpu[5]) == bool(cpu[5]) and torch.equal(gpu[6][:4].cpu(), cpu[6][:4])
