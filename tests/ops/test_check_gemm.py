"""check_gemm on the CPU and on CUDA (csrc/bindings/abft_check.cpp, abft_matrix_check.cpp) against
its composite, the ops it is made of (encode_pair, add_bias, verify_correct), which torch.compile
traces: the same results and the same output, bit for bit, for clean and faulty GEMMs of every
layout; the CPU's fused screen takes matrices and batches of them that broadcast as the composite
broadcasts them, CUDA (emulated) a 2-D GEMM on one scratch tensor, every other input goes to the
composite. compiled.screen_passes, the CPU's screen alone, passes only what the composite finds
clean, and ends a clean check on the CPU."""

import re

import pytest
import torch
from cuda_targets import TARGETS
from hypothesis import given
from hypothesis import strategies as st
from test_ext import DTYPES, EMULATED_PROPERTY, PROPERTY, corrupted, needs_emulator, needs_ext
from test_ext_correct import bits

from megatron_abft import _C
from megatron_abft.check.checker import signature
from megatron_abft.check.eec import OUTCOMES, GemmOperands
from megatron_abft.check.ledger import Ledger
from megatron_abft.check.sides import Check, side_bounds
from megatron_abft.check.tolerance import gemm_rounding
from megatron_abft.config import ABFTConfig
from megatron_abft.ops import compiled
from megatron_abft.runtime.guard import SectionGuard


def _operands(dtype, batch, m, k, n, bias, seed, layout):
    """alpha = -0.5 and a @ b (+ bias) rounded once to ``dtype``, ``batch`` a's and b's batch
    shapes (or one for a, b a matrix); b a transposed weight, or stored row by row, a
    column-major (``layout``)."""
    g = torch.Generator().manual_seed(seed)
    a_batch, b_batch = batch if batch and isinstance(batch[0], tuple) else (batch, ())
    a = torch.randn(*a_batch, m, k, generator=g).to(dtype)
    b = torch.randn(*b_batch, k, n, generator=g).to(dtype)
    if layout in ("weight", "both"):
        b = b.mT.contiguous().mT
    if layout in ("column-major a", "both"):
        a = a.mT.contiguous().mT
    bias_t = torch.randn(n, generator=g).to(dtype) if bias else None
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    c = -0.5 * (a.to(wide) @ b.to(wide)) + (0 if bias_t is None else bias_t.to(wide))
    return a, b, bias_t, c.to(dtype)


def _arguments(c, a, b, bias, block):
    check = Check(gemm_rounding(c.dtype, c.device), 1.0, 0, 0, None)
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    bounds = [side_bounds(check, block, length, k) for length in (m, n)]
    return (a, b, -0.5, bias, block, *bounds, 1e30, max(m, n))


def _screen_passes(c, arguments) -> bool:
    """compiled.screen_passes on ``c`` with check_gemm's ``arguments`` (near_inf aside)."""
    return compiled.screen_passes(c, *arguments[:7], arguments[8])


def _both(c, arguments, tally: bool):
    """The op's results and output (the CPU kernel) and its composite's, each on its own copy
    of ``c`` (and its own ledger)."""
    op = torch.ops.megatron_abft.check_gemm_tally if tally else torch.ops.megatron_abft.check_gemm
    runs = []
    for run in (op.default, op.default.decompose):
        out = c.clone()
        ledger = Ledger.on(c.device, 3)
        extra = (ledger.counts, ledger.clock, ledger.log, ledger.logged) if tally else ()
        found = run(out, *arguments, *extra)
        runs.append((found, out, ledger))
    return runs


# a GEMM's settings and its output's fault, for the property tests
GEMMS = {
    "dtype": st.sampled_from(DTYPES),
    "m": st.integers(2, 90),
    "k": st.integers(1, 40),
    "n": st.integers(2, 90),
    "block": st.sampled_from([2, 16, 64]),
    "bias": st.booleans(),
    "layout": st.sampled_from(["contiguous", "weight", "column-major a", "both"]),
    "c_layout": st.sampled_from(["contiguous", "column-major"]),
    "kind": st.sampled_from(["none", "none", "inf", "nan", "value", "bitflip"]),
    "pattern": st.sampled_from(["0d", "row", "2d"]),
    "tally": st.booleans(),
    "seed": st.integers(0, 2**16),
}


def _assert_same(runs) -> None:
    """The op's results, output and ledger (``_both``'s first run) are its composite's, bit for
    bit."""
    (found, out, ledger), (want, want_out, want_ledger) = runs
    for got, expected in zip(found, want, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(bits(out.cpu()), bits(want_out.cpu()))
    for name in ("counts", "logged", "log"):
        torch.testing.assert_close(
            getattr(ledger, name), getattr(want_ledger, name), rtol=0, atol=0, equal_nan=True
        )


@needs_ext
@PROPERTY
@given(
    batch=st.sampled_from(
        [(), (), (2,), ((2,), (2,)), ((), (2,)), ((2, 3), (2, 1)), ((2, 1), (1, 3)), ((3,), (2, 1))]
    ),
    **GEMMS,
)
def test_check_gemm_on_the_cpu_equals_its_composite(
    dtype, batch, m, k, n, block, bias, layout, c_layout, kind, pattern, tally, seed
):
    a, b, bias_t, c = _operands(dtype, batch, m, k, n, bias, seed, layout)
    c = corrupted(c, kind, pattern, c_layout, seed)
    arguments = _arguments(c, a, b, bias_t, block)
    try:
        runs = _both(c, arguments, tally)
    except RuntimeError as error:  # operands the kernels refuse: refused by both
        first = re.escape(str(error).splitlines()[0])
        with pytest.raises(RuntimeError, match=first):
            torch.ops.megatron_abft.check_gemm.default.decompose(c.clone(), *arguments)
        return
    (found, out, _), (want, _, _) = runs
    if _screen_passes(c, arguments):  # only what both find clean, and leave as it is
        assert not found[0].any() and not want[0].any()
        assert torch.equal(bits(out), bits(c))
    _assert_same(runs)


@needs_emulator
@EMULATED_PROPERTY
@given(**GEMMS)
def test_a_matrix_check_on_cuda_equals_its_composite(
    dtype, m, k, n, block, bias, layout, c_layout, kind, pattern, tally, seed
):
    """A 2-D GEMM's check on CUDA (emulated) on one scratch tensor: the composite's results,
    ledger and output, bit for bit."""
    a, b, bias_t, c = _operands(dtype, (), m, k, n, bias, seed, layout)
    c = corrupted(c, kind, pattern, c_layout, seed)
    arguments = _arguments(c, a, b, bias_t, block)
    with compiled.emulated_cuda():
        _assert_same(_both(c, arguments, tally))


@pytest.mark.parametrize("gpu", TARGETS)
@pytest.mark.parametrize(
    "dtype, bias, kind, pattern",
    [
        (torch.bfloat16, True, "value", "0d"),
        (torch.float16, False, "nan", "row"),
        (torch.float32, True, "bitflip", "2d"),
        (torch.bfloat16, False, "none", "0d"),
    ],
)
def test_a_projection_check_on_cuda_equals_its_composite(gpu, dtype, bias, kind, pattern):
    """A projection's shapes (tokens x hidden by a transposed weight, 12 and 8 blocks of 32: more
    vectors than one pass of the products kernel): the one-scratch check's results, ledger and
    output are the composite's, bit for bit, on a GPU as emulated."""
    a, b, bias_t, c = _operands(dtype, (), 384, 64, 256, bias, 5, "weight")
    c = corrupted(c, kind, pattern, "contiguous", 5)
    d = gpu.device
    on = [t if t is None else t.to(d) for t in (a, b, bias_t, c)]
    arguments = _arguments(on[3], *on[:3], 32)
    with gpu.kernels():
        runs = _both(on[3], arguments, True)
    _assert_same(runs)
    assert (kind == "none") == (int(runs[0][2].counts[0].sum()) == 0)


@needs_emulator
@pytest.mark.parametrize("bias", [False, True])
def test_a_matrix_check_on_cuda_makes_seven_tensors_and_calls_no_op(bias):
    """On CUDA a 2-D GEMM's sync-free check (the projections') makes its five results, tally's
    verdict and one scratch tensor, and calls no other op; a batch goes to the composite."""
    a, b, bias_t, c = _operands(torch.bfloat16, (), 96, 64, 80, bias, 4, "weight")
    arguments = _arguments(c, a, b, bias_t, 32)
    ledger = Ledger.on(c.device, 3)
    extra = (ledger.counts, ledger.clock, ledger.log, ledger.logged)
    op = torch.ops.megatron_abft.check_gemm_tally.default
    with compiled.emulated_cuda():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            op(c.clone(), *arguments, *extra)
        names = [e.name for e in prof.events()]
        assert names.count("aten::empty") == 7, names
        assert [n for n in names if n.startswith("megatron_abft::")] == [
            "megatron_abft::check_gemm_tally"
        ]
        batch = _operands(torch.bfloat16, (2,), 96, 64, 80, bias, 4, "weight")
        arguments = _arguments(batch[3], *batch[:3], 32)
        assert "megatron_abft::verify_correct_tally" in _ops_run(
            lambda: op(batch[3].clone(), *arguments, *extra)
        )


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_fault_the_fused_screen_finds_is_corrected_by_the_composite(dtype):
    """A 2-d check's faulty output: flagged by the CPU's fused screen and corrected, as the
    composite corrects it; the clean one passes untouched."""
    a, b, bias, clean = _operands(dtype, (), 70, 24, 50, True, 3, "weight")
    arguments = _arguments(clean, a, b, bias, 32)
    out = clean.clone()
    status = torch.ops.megatron_abft.check_gemm(out, *arguments)[0]
    assert int(status) == 0 and torch.equal(bits(out), bits(clean))
    faulty = clean.clone()
    faulty[40, 7] = 1e4
    status = torch.ops.megatron_abft.check_gemm(faulty, *arguments)[0]
    assert int(status) == 1  # corrected
    torch.testing.assert_close(faulty.float(), clean.float(), rtol=0.05, atol=0.05)


def _ops_run(call) -> set[str]:
    """The megatron_abft ops that ``call`` runs (the profiler's record of them)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        call()
    return {e.name for e in prof.events() if e.name.startswith("megatron_abft::")}


@needs_ext
@pytest.mark.parametrize("batch", [(), ((2, 3), (2, 1))], ids=["matrix", "broadcast batch"])
def test_a_clean_check_runs_no_op_but_its_own_on_the_cpu(batch):
    """The CPU's fused screen settles a clean check alone, of a matrix or of a batch whose
    operands broadcast (as the attention's, K and V shared by a KV group's heads); a flagged
    one goes through the composite's ops."""
    a, b, bias, clean = _operands(torch.float32, batch, 64, 32, 48, True, 1, "weight")
    arguments = _arguments(clean, a, b, bias, 16)
    op = torch.ops.megatron_abft.check_gemm.default
    assert _ops_run(lambda: op(clean.clone(), *arguments)) == {"megatron_abft::check_gemm"}
    faulty = clean.clone()
    faulty[..., 3, 5] = float("inf")
    assert "megatron_abft::verify_correct" in _ops_run(lambda: op(faulty, *arguments))


@needs_ext
@pytest.mark.parametrize("batch", [(), ((2, 3), (2, 1))], ids=["matrix", "broadcast batch"])
def test_a_guards_clean_check_on_the_cpu_ends_at_the_screen(batch):
    """Where the host reads results (the CPU), a guard's clean check is compiled.screen_passes
    alone, which runs no op and makes no tensor; a faulty one goes on to check_gemm, which
    corrects it."""
    a, b, bias, clean = _operands(torch.float32, batch, 64, 32, 48, True, 2, "weight")
    operands = GemmOperands(a, b, -0.5, bias)
    guard = SectionGuard("qkv", ABFTConfig(), 0)
    guard.check(clean.clone(), operands)  # the first of a signature takes the reference
    out = clean.clone()
    assert _ops_run(lambda: guard.check(out, operands)) == set()
    assert torch.equal(out, clean)
    assert _screen_passes(clean, _arguments(clean, a, b, bias, ABFTConfig().block_size))
    faulty = clean.clone()
    faulty[..., 5, 3] = 1e4
    assert "megatron_abft::check_gemm" in _ops_run(lambda: guard.check(faulty, operands))
    torch.testing.assert_close(faulty, clean, rtol=1e-3, atol=1e-3)
    assert int(guard.counts[OUTCOMES.index("corrected")].sum()) == (6 if batch else 1)


@needs_ext
def test_a_guard_asks_its_signatures_screen_first(monkeypatch):
    """Once a signature's checker ends its clean checks at the CPU's screen, the guard asks that
    screen first (SectionGuard.screen): no signature and no checker's choice. A fault
    still goes on to check_gemm and is corrected; another shape, a changed block or threshold,
    or the kernels disabled take the whole path again."""
    import megatron_abft.runtime.guard as guard_module

    a, b, bias, clean = _operands(torch.float32, (), 64, 32, 48, True, 3, "weight")
    operands = GemmOperands(a, b, -0.5, bias)
    config = ABFTConfig()
    guard = SectionGuard("qkv", config, 0)
    for _ in range(2):  # the reference, then the checker chosen for the signature
        guard.check(clean.clone(), operands)
    assert guard.screen is not None
    calls = []
    monkeypatch.setattr(guard_module, "signature", lambda *a: calls.append(1) or signature(*a))

    def whole_path(output, operands) -> bool:
        """Whether a check of ``output`` went past the screen the guard keeps."""
        calls.clear()
        assert guard.check(output, operands) is output
        return bool(calls)

    out = clean.clone()
    assert not whole_path(out, operands) and torch.equal(out, clean)
    faulty = clean.clone()
    faulty[7, 3] = 1e4
    assert whole_path(faulty, operands)
    torch.testing.assert_close(faulty, clean, rtol=1e-3, atol=1e-3)
    assert int(guard.counts[OUTCOMES.index("corrected")].sum()) == 1
    narrower = GemmOperands(a[:, :16], b[:16], -0.5, bias)
    narrow = torch.addmm(bias, a[:, :16], b[:16], alpha=-0.5)
    # a new signature: the reference's check, then its checker's, then the screen alone
    assert [whole_path(narrow, narrower) for _ in range(3)] == [True, True, False]
    # back to the first signature: its checker kept, its screen taken up again
    assert [whole_path(clean.clone(), operands) for _ in range(2)] == [True, False]
    for field, value in (("block_size", 16), ("threshold_scale", 2 * config.threshold_scale)):
        setattr(config, field, value)
        paths = [whole_path(clean.clone(), operands) for _ in range(3)]
        assert paths == [True, True, False], field
    with compiled.disabled():
        assert whole_path(clean.clone(), operands)
    assert int(guard.counts[OUTCOMES.index("corrected")].sum()) == 1


@needs_ext
def test_the_screen_refuses_what_is_not_a_check():
    """screen_passes names a wrong argument instead of reading it."""
    a, b, bias, c = _operands(torch.float32, (), 8, 4, 6, True, 0, "contiguous")
    arguments = _arguments(c, a, b, bias, 16)
    with pytest.raises(TypeError, match="b must be a tensor"):
        compiled.screen_passes(c, a, "b", *arguments[2:7], arguments[8])
    with pytest.raises(TypeError, match="9 arguments"):
        _C.screen_passes(c, a, b)


@needs_ext
@pytest.mark.parametrize("kind", ["none", "inf", "value"])
def test_a_batch_screened_on_several_threads_equals_its_composite(kind):
    """Matrices large enough that the fused screen takes them on parallel threads (V shared by
    the batch, as a KV group's): the same results and output as the composite, bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        a, b, bias, c = _operands(torch.float32, ((4,), (1,)), 200, 64, 180, False, 5, "contiguous")
        c = corrupted(c, kind, "0d", "contiguous", 5)
        (found, out, _), (want, want_out, _) = _both(c, _arguments(c, a, b, bias, 64), False)
    finally:
        torch.set_num_threads(threads)
    for got, expected in zip(found, want, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(bits(out), bits(want_out))
