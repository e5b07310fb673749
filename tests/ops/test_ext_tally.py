"""The compiled tally (megatron_abft::tally): what a guard adds to its ledger (counters and fault
log) from a check's per-matrix results, in one op, against Ledger.tally's PyTorch twin; and
verify_correct_tally, the check and its tally in one op."""

import pytest
import torch
from cuda_targets import TARGETS
from hypothesis import example, given
from hypothesis import strategies as st
from test_ext import PROPERTY, needs_cuda, needs_emulator, needs_ext
from test_ext_correct import _sides, bits, case, recompute_tolerance

from megatron_abft.check.checksum import encode
from megatron_abft.check.eec import (
    CORRECTED,
    KINDS,
    EECResult,
    GemmOperands,
    _kernel_check,
    verify_and_correct,
)
from megatron_abft.check.ledger import Ledger, set_clocks
from megatron_abft.check.sides import Check
from megatron_abft.check.tolerance import gemm_rounding
from megatron_abft.config import ABFTConfig
from megatron_abft.faults import TensorFault, inject_
from megatron_abft.ops import compiled
from megatron_abft.runtime.guard import SectionGuard


def results(batch: tuple[int, ...], seed: int, dtype=torch.float32, statuses=3) -> EECResult:
    """Per-matrix results as a check returns them, drawn at random (status below ``statuses``)."""
    g = torch.Generator().manual_seed(seed)
    status = torch.randint(0, statuses, batch, generator=g).to(torch.int8)
    kind = torch.randint(0, len(KINDS), batch, generator=g).to(torch.int8)
    row, col = torch.randint(-1, 500, (2, *batch), generator=g)
    magnitude = torch.randn(batch, generator=g, dtype=dtype).exp()
    magnitude[torch.rand(batch, generator=g) < 0.1] = float("nan")
    return EECResult(status, kind, row, col, magnitude)


def tallied(found: EECResult, step: int, kernels: bool, times: int = 3, capacity: int = 2):
    """A ledger of ``capacity`` records, and the failed flags, after tallying ``found``
    ``times`` times, with the kernels or with the PyTorch twin."""
    ledger = Ledger.on(torch.device("cpu"), step, capacity)
    failed = []
    for _ in range(times):
        if kernels:
            failed.append(ledger.tally(found))
        else:
            with compiled.disabled():
                failed.append(ledger.tally(found))
    return ledger, failed


def assert_same_ledger(got: Ledger, want: Ledger):
    assert torch.equal(got.counts, want.counts) and torch.equal(got.logged, want.logged)
    torch.testing.assert_close(got.log, want.log, equal_nan=True, rtol=0, atol=0)


@needs_ext
@PROPERTY
@given(
    batch=st.lists(st.integers(1, 40), min_size=1, max_size=3).map(tuple),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    statuses=st.integers(1, 3),
    step=st.integers(0, 10**6),
    capacity=st.integers(1, 4),
)
@example((1,), 0, torch.float32, 1, 0, 1)  # one clean matrix
@example((300,), 1, torch.float64, 3, 7, 2)  # more matrices than one thread block of the CUDA op
def test_tally_equals_the_pytorch_twin(batch, seed, dtype, statuses, step, capacity):
    found = results(batch, seed, dtype, statuses)
    ledger, failed = tallied(found, step, kernels=True, capacity=capacity)
    want, want_failed = tallied(found, step, kernels=False, capacity=capacity)
    assert_same_ledger(ledger, want)
    assert all(f.dtype == torch.bool and f.shape == () for f in failed)
    assert [bool(f) for f in failed] == [bool(f) for f in want_failed]
    assert int(ledger.logged) == (3 if bool(found.status.any()) else 0)


@needs_ext
@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "pytorch"])
def test_tally_counts_by_outcome_and_kind_and_logs_the_first_worst_matrix(kernels):
    status = torch.tensor([0, 1, 2, 1, 2, 0], dtype=torch.int8)
    kind = torch.tensor([0, 3, 1, 3, 2, 0], dtype=torch.int8)
    row, col = torch.arange(6) * 10, torch.arange(6) * 100
    magnitude = torch.tensor([0.0, 1.5, 2.5, 3.5, 4.5, 0.0])
    ledger = Ledger.on(torch.device("cpu"), 9, capacity=2)
    ledger.counts += 1  # added to, not overwritten

    def tally(n: int) -> bool:
        found = EECResult(status[:n], kind[:n], row[:n], col[:n], magnitude[:n])
        if kernels:
            return bool(ledger.tally(found))
        with compiled.disabled():
            return bool(ledger.tally(found))

    assert tally(6)
    want = torch.ones(3, len(KINDS), dtype=torch.int64)
    want[0] += torch.tensor([0, 1, 1, 2])  # detected: every matrix not clean, by kind
    want[1] += torch.tensor([0, 0, 0, 2])  # corrected
    want[2] += torch.tensor([0, 1, 1, 0])  # uncorrectable
    assert torch.equal(ledger.counts, want)
    set_clocks([ledger], 3)
    assert not tally(1)  # clean: counted as nothing, not logged
    assert not tally(2)
    assert ledger.log.tolist() == [
        [9.0, 2.0, 2.0, 1.0, 20.0, 200.0, 2.5],
        [3.0, 1.0, 1.0, 3.0, 10.0, 100.0, 1.5],
    ]
    assert tally(6)  # past the log's capacity: counted, not logged
    assert int(ledger.logged) == 3 and ledger.log[1, 0] == 3.0
    assert int(ledger.counts[2].sum()) == len(KINDS) + 2 + 2  # the ones, then 2 a tally


@needs_ext
def test_tally_opcheck():
    found = results((3, 5), seed=4)
    ledger = Ledger.on(torch.device("cpu"), 5, capacity=4)
    torch.library.opcheck(
        torch.ops.megatron_abft.tally.default,
        (*found.fields, ledger.counts, ledger.clock, ledger.log, ledger.logged),
    )


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
        ({"step": torch.zeros(1)}, "step .* want one float64"),
        ({"step": torch.zeros(2, dtype=torch.float64)}, "step .* want one float64"),
        ({"log": torch.zeros(4, 6, dtype=torch.float64)}, r"log .* want a contiguous float64"),
        ({"log": torch.zeros(7, 4, dtype=torch.float64).t()}, "log .* want a contiguous"),
        ({"logged": torch.zeros(1, dtype=torch.int32)}, "logged .* want one int64"),
    ],
)
def test_tally_bad_inputs_raise_clear_errors(change, message):
    found = dict(
        zip(("status", "kind", "row", "col", "magnitude"), results((6,), 2).fields, strict=True)
    )
    ledger = Ledger.on(torch.device("cpu"), 1, capacity=4)
    kept = {"counts": ledger.counts, "step": ledger.clock, "log": ledger.log}
    args = found | kept | {"logged": ledger.logged} | change
    with pytest.raises(RuntimeError, match=message):
        torch.ops.megatron_abft.tally(*args.values())
    empty = [t[:0] for t in found.values()]
    with pytest.raises(RuntimeError, match="tally: no matrices"):
        torch.ops.megatron_abft.tally(*empty, *list(args.values())[5:])


def test_a_ledger_keeps_at_least_one_record():
    with pytest.raises(ValueError, match="at least one log record"):
        Ledger.on(torch.device("cpu"), 0, capacity=0)


def _guard_check(c, operands, kernels: bool):
    """A scores guard's check of ``c``: its counters, events and pending flag, and the number
    of top-level ops the check launched (torch.profiler)."""
    guard = SectionGuard("scores", ABFTConfig(on_uncorrectable="log"), 0)
    guard.step = 4
    c = c.clone()
    guard.check(c.clone(), operands)  # the ledger is made on the first check
    guard.pending = None  # as at the start of a step (guard.set_step)
    guard.reset()
    cpu = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=cpu, acc_events=True) as profile:
        if kernels:
            guard.check(c, operands)
        else:
            with compiled.disabled():
                guard.check(c, operands)
    ops = sum(1 for e in profile.events() if e.cpu_parent is None and "::" in e.name)
    return guard, c, ops


@needs_ext
@pytest.mark.parametrize("batch", [(2, 4), ()], ids=["batched", "one matrix"])
def test_a_guard_s_check_with_the_kernels_is_a_few_ops_and_counts_as_the_pytorch_path(batch):
    """On the CPU, where the host reads results, a clean check runs no op (compiled.screen_passes
    alone); a corrected one is check_gemm, the host read of the worst status and the tally. One
    matrix (a linear layer's GEMM) costs no more ops than a batch. Counters, fault log and the
    pending flag equal the PyTorch path's."""
    c, refs, operands = case(torch.bfloat16, batch, 128, 96, 32, False, ("col", "row"), seed=5)
    _, _, clean_ops = _guard_check(c, operands, kernels=True)
    inject_(c, TensorFault("nan", "0d", batch_index=3 if batch else None, seed=5))
    if batch:
        inject_(c, TensorFault("value", "row", value=1e3, batch_index=6, seed=5))
    guard, fixed, ops = _guard_check(c, operands, kernels=True)
    reference, want, _ = _guard_check(c, operands, kernels=False)
    assert clean_ops == 0 and ops <= 4, (clean_ops, ops)
    assert torch.equal(guard.counts, reference.counts)
    assert int(guard.counts[1].sum()) == (2 if batch else 1)
    assert not bool(guard.pending) and not bool(reference.pending)
    assert int(guard.ledger.logged) == int(reference.ledger.logged) == 1
    torch.testing.assert_close(
        guard.ledger.log[0], reference.ledger.log[0], rtol=1e-6, atol=0, equal_nan=True
    )
    torch.testing.assert_close(fixed, want, rtol=0.01, atol=1e-3)


@pytest.mark.parametrize("gpu", TARGETS)
@pytest.mark.parametrize("batch", [(1,), (3, 7), (700,)])
def test_cuda_tally_equals_the_cpu_op(batch, gpu):
    found = results(batch, seed=len(batch), dtype=torch.float64)
    found.status.reshape(-1)[-1] = 2  # ties: the first uncorrectable matrix is the worst
    on_gpu = EECResult(*(t.to(gpu.device) for t in found.fields))
    cpu = Ledger.on(torch.device("cpu"), 11, capacity=2)
    ledger = Ledger.on(gpu.device, 11, capacity=2)
    ledger.counts += 1  # added to
    want = [bool(cpu.tally(found)) for _ in range(3)]
    with gpu.kernels():
        assert [bool(ledger.tally(on_gpu)) for _ in range(3)] == want
        copies = (ledger.counts.clone(), ledger.clock, ledger.log.clone(), ledger.logged.clone())
        torch.library.opcheck(torch.ops.megatron_abft.tally.default, (*on_gpu.fields, *copies))
    ledger.counts -= 1
    assert_same_ledger(Ledger(*(t.cpu() for t in vars(ledger).values())), cpu)


@needs_ext
@pytest.mark.parametrize("lost", [5, 7, 8], ids=["counts", "log", "logged"])
def test_the_kernel_selftest_checks_the_tally(monkeypatch, lost):
    """A tally that writes to a copy of one of the ledger's tensors fails the self-test."""
    from megatron_abft.ops.selftest import mismatches

    assert mismatches(torch.device("cpu")) == []
    real = torch.ops.megatron_abft.tally

    def loses_a_write(*args):
        return real(*(t.clone() if i == lost else t for i, t in enumerate(args)))

    monkeypatch.setattr(torch.ops.megatron_abft, "tally", loses_a_write)
    assert mismatches(torch.device("cpu")) == ["tally"]


@needs_cuda
def test_a_sync_free_check_on_the_gpu_reads_nothing_and_launches_what_the_model_counts():
    """The path the overhead model costs for a GPU: with the kernels, a clean sync-free check
    launches the kernels devices.CHECK_KERNELS counts, and a clean check and a faulty one never
    synchronise with the host (torch.cuda's sync debug mode raises on any synchronising call)."""
    from bench.overhead import check_kernels
    from megatron_abft.tuning.devices import CHECK_KERNELS

    kernels = check_kernels(torch.device("cuda"))
    assert len(kernels) == CHECK_KERNELS["kernels"], f"a clean check launched {kernels}"
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
    corrects, counts and logs a fault landed before each replay, at the step set_step gave the
    replay (the ledger lives on the device, its clock included)."""
    from megatron_abft import collect_events, set_step

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
    model = torch.nn.Module()
    model.abft_guards = [guard]
    guard.reset()  # in place: the graph keeps writing the same ledger
    for replay in range(3):
        set_step(model, 10 + replay)
        static.copy_(clean)
        static[1, replay, 5 + replay, 7] += 1e3
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(static, clean, **recompute_tolerance(torch.float32))
    assert int(guard.counts[1].sum()) == 3 and int(guard.counts[2].sum()) == 0
    events = collect_events(model)
    assert [(e["step"], e["row"], e["col"]) for e in events] == [
        (10 + r, 5 + r, 7) for r in range(3)
    ]


def checked(c, refs, operands, ledger=None):
    """The kernels' check of ``c`` in place, alone or tallied into ``ledger``."""
    check = Check(gemm_rounding(c.dtype, c.device), 1.0, 1e10, max(c.shape[-2:]), operands)
    return _kernel_check(c, refs, check, ledger)


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
    want = Ledger.on(torch.device("cpu"), step)
    want.counts += 1  # added to, not overwritten
    want_failed = compiled.tally(found, want)
    ledger = Ledger.on(torch.device("cpu"), step)
    ledger.counts += 1
    *got, failed = checked(fused, refs, operands, ledger)
    for g, w in zip(got, found, strict=True):
        assert torch.equal(bits(g), bits(w))
    assert torch.equal(bits(fused), bits(alone))
    assert_same_ledger(ledger, want)
    assert bool(failed) == bool(want_failed)
    assert int(ledger.logged) == (0 if kind == "none" else 1)


@needs_ext
def test_verify_correct_tally_opcheck_and_its_place_in_a_check():
    """opcheck on the op; in verify_and_correct it tallies only a sync-free check off the CPU
    (on a CPU, and with sync_free=False, the PyTorch path may still change what was found, so
    the caller tallies)."""
    c, refs, operands = faulty_case(torch.float32, 3, "value", "0d")
    ledger = Ledger.on(torch.device("cpu"), 2)
    args = (c.clone(), *_sides(c, refs, operands), operands.a, operands.b, 0.5, operands.bias)
    torch.library.opcheck(
        torch.ops.megatron_abft.verify_correct_tally.default,
        (*args, 1e10, 40, ledger.counts, ledger.clock, ledger.log, ledger.logged),
    )
    ledger = Ledger.on(torch.device("cpu"), 2)
    result = verify_and_correct(c, **refs, operands=operands, ledger=ledger, sync_free=True)
    assert result.tallied is None and not ledger.counts.any() and not ledger.logged.any()
    assert int((result.status == CORRECTED).sum()) == 1


@pytest.mark.parametrize("gpu", TARGETS)
def test_cuda_verify_correct_tally_equals_the_cpu_op(gpu):
    """In one launch on CUDA: the correction, then the tally of what it found."""
    cpu_c, cpu_refs, cpu_operands = faulty_case(torch.bfloat16, 4, "nan", "row")
    ledgers = [Ledger.on(torch.device("cpu"), 9), Ledger.on(gpu.device, 9)]
    cpu = checked(cpu_c, cpu_refs, cpu_operands, ledgers[0])
    with gpu.kernels():
        gpu_c, gpu_refs, gpu_operands = faulty_case(torch.bfloat16, 4, "nan", "row", gpu.device)
        found = checked(gpu_c, gpu_refs, gpu_operands, ledgers[1])
    for got, want in zip(found[:2], cpu[:2], strict=True):
        assert torch.equal(got.cpu(), want)
    torch.testing.assert_close(
        gpu_c.cpu(), cpu_c, equal_nan=True, **recompute_tolerance(torch.bfloat16)
    )
    cpu_ledger, gpu_ledger = ledgers
    assert torch.equal(gpu_ledger.counts.cpu(), cpu_ledger.counts)
    assert int(cpu_ledger.counts[1].sum()) == 1 and bool(found[5]) == bool(cpu[5])
    assert int(gpu_ledger.logged) == int(cpu_ledger.logged) == 1
    assert torch.equal(gpu_ledger.log[0, :6].cpu(), cpu_ledger.log[0, :6])


@needs_emulator
def test_on_cuda_verify_correct_tally_makes_no_view():
    """The references and operands are read where they are, broadcast over the batch (the
    operands b and the bias shared by its 6 matrices), and the correction's scratch is one
    tensor: the op's calls into ATen are its allocations alone."""
    c, refs, operands = faulty_case(torch.bfloat16, 4, "nan", "row")
    ledger = Ledger.on(c.device, 9)
    with compiled.emulated_cuda():
        checked(c.clone(), refs, operands, ledger)  # the references encoded, the checker chosen
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            checked(c, refs, operands, ledger)
    inside = [e.name for e in prof.events() if _under(e, "megatron_abft::verify_correct_tally")]
    assert inside and set(inside) <= {"aten::empty"}, inside
    assert int(ledger.counts[1].sum()) == 2  # corrected, both times


def _under(event, name: str) -> bool:
    """Whether a profiler event runs inside op ``name`` (not the op itself)."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == name:
            return True
        parent = parent.cpu_parent
    return False
