"""A guard's compiled checker (megatron_abft.check.checker) against the reference: the same
output, bit for bit, the same ledger and the same verdict, for every fault; chosen afresh for any
change of layout or setting; bad input still explained."""

import pytest
import torch
from cuda_targets import TARGETS
from hypothesis import given
from hypothesis import strategies as st
from test_ext import DTYPES, PROPERTY, corrupted, gemm_case, needs_ext
from test_ext_correct import bits

from megatron_abft.check.checker import (
    LEFT_TO_REFERENCE,
    CompiledChecker,
    ReferenceChecker,
    choose,
    signature,
)
from megatron_abft.check.checksum import encode
from megatron_abft.check.eec import GemmOperands
from megatron_abft.config import ABFTConfig
from megatron_abft.faults import TensorFault, inject_
from megatron_abft.ops import compiled
from megatron_abft.runtime.guard import MAX_CHECKERS, SectionGuard


def gemm(dtype, batch, m, n, bias, seed, weight=True):
    """A GEMM's operands (alpha 0.5) and its output, computed in fp32 (fp64) and rounded once.
    ``weight``: b is a transposed weight, as the linear layers give it, else stored row by
    row (where b is the larger operand, encode_pair then does not take it, a column-major
    operand, and the compiled checker is not chosen)."""
    a, b, bias_t, _ = gemm_case(dtype, batch, m, 16, n, seed, bias)
    if weight:
        b = b.mT.contiguous().mT
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    c = 0.5 * (a.to(wide) @ b.to(wide)) + (0 if bias_t is None else bias_t.to(wide))
    return GemmOperands(a, b, 0.5, bias_t), c.to(dtype)


def compiled_guard(operands, c, config, refs=None, expect_compiled=True) -> SectionGuard:
    """A guard that has checked ``c`` clean once, and so chosen its signature's checker (if
    ``expect_compiled``, the compiled one)."""
    guard = SectionGuard("proj", config, 0)
    assert guard._verify(c.clone(), operands, refs) is None
    checker = guard.checkers[signature(c, operands, refs, config, False)]
    assert isinstance(checker, CompiledChecker) or not expect_compiled
    return guard


def assert_same_ledger(one, other) -> None:
    for name in ("counts", "logged", "log"):  # a NaN's magnitude logged is NaN
        torch.testing.assert_close(
            getattr(one, name), getattr(other, name), rtol=0, atol=0, equal_nan=True
        )


@needs_ext
@PROPERTY
@given(
    dtype=st.sampled_from(DTYPES),
    batch=st.sampled_from([(), (2,), (2, 3)]),
    m=st.integers(2, 160),
    n=st.integers(2, 160),
    block=st.sampled_from([2, 16, 64]),
    bias=st.booleans(),
    given_refs=st.booleans(),
    weight=st.booleans(),
    layout=st.sampled_from(["contiguous", "column-major"]),
    kind=st.sampled_from(["inf", "nan", "near_inf", "value", "bitflip", "none"]),
    pattern=st.sampled_from(["0d", "row", "col", "2d"]),
    seed=st.integers(0, 2**16),
)
def test_the_compiled_checker_equals_the_reference(
    dtype, batch, m, n, block, bias, given_refs, weight, layout, kind, pattern, seed
):
    operands, clean = gemm(dtype, batch, m, n, bias, seed, weight)
    clean = corrupted(clean, "none", pattern, layout, seed)  # in the layout under test
    refs = None
    if given_refs:
        refs = encode(operands.a, operands.b, alpha=0.5, bias=operands.bias, block=block)
    config = ABFTConfig(block_size=block)
    by_checker = compiled_guard(operands, clean, config, refs, expect_compiled=given_refs)
    by_reference = SectionGuard("proj", config, 0)
    c = corrupted(clean.clone(), kind, pattern, "contiguous", seed)  # clone keeps the layout
    c_reference = c.clone()
    failed = by_checker._verify(c, operands, refs)
    reference = ReferenceChecker(config, False)
    want = reference.run(c_reference, operands, refs, by_reference.ledger_on(c.device))
    assert torch.equal(bits(c), bits(c_reference))
    assert (failed is None) == (want is None)
    if want is not None:
        assert torch.equal(failed, want)
    assert_same_ledger(by_checker.ledger, by_reference.ledger)


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fault", ["0d", "row", "2d"])
def test_a_sync_free_checker_tallies_in_its_op_what_the_host_checker_tallies(dtype, fault):
    """Sync-free (a GPU's default), the checker's verify_correct_tally settles and tallies in
    one op; where a check may read the host it reads the verdict, and hands a matrix the kernels
    could not settle to the reference (LEFT_TO_REFERENCE), which the sync-free checker counts
    uncorrectable, with the output put back bit for bit."""
    operands, clean = gemm(dtype, (2, 3), 96, 80, True, seed=5)
    config = ABFTConfig(block_size=32)
    c = clean.clone()
    if fault == "2d":
        c[1, 2, 10:30, 10:30] = float("nan")  # a 2D fault: none of it can be rebuilt
    else:
        inject_(c[1, 2], TensorFault("nan" if fault == "0d" else "value", fault, value=1e4))
    faulty = c.clone()
    results = {}
    for sync_free in (True, False):
        plan = choose(c, operands, None, config, sync_free)
        assert isinstance(plan, CompiledChecker)
        guard = SectionGuard("proj", config, 0)
        out = c.clone()
        results[sync_free] = plan.settle(out, operands, None, guard.ledger_on(c.device)), out, guard
    (failed, out, guard), (verdict, host_out, host_guard) = results[True], results[False]
    if fault == "2d":
        assert verdict is LEFT_TO_REFERENCE
        assert bool(failed)
        assert torch.equal(bits(out), bits(faulty))
        assert guard.ledger.counts[2].sum() == 1  # one matrix uncorrectable
        return
    assert not bool(failed) and not bool(verdict)
    assert torch.equal(bits(out), bits(host_out))
    assert_same_ledger(guard.ledger, host_guard.ledger)
    assert guard.ledger.counts[1].sum() == 1  # one matrix corrected


@needs_ext
def test_a_changed_layout_or_setting_chooses_afresh():
    operands, c = gemm(torch.float32, (2,), 64, 48, False, seed=1)
    config = ABFTConfig(block_size=16)
    guard = compiled_guard(operands, c, config)
    config.threshold_scale = 4.0
    guard.check(c.clone(), operands)
    assert len(guard.checkers) == 2
    (old, new) = guard.checkers.values()
    assert new.bounds[0][0] == 4 * old.bounds[0][0]  # the thresholds scale
    with compiled.disabled():  # the PyTorch path: the reference checker
        guard.check(c.clone(), operands)
    assert len(guard.checkers) == 3
    assert isinstance(list(guard.checkers.values())[-1], ReferenceChecker)
    for rows in range(3, 3 + MAX_CHECKERS):  # shapes that keep changing: a bounded cache
        a = torch.randn(2, rows, 16)
        guard.check(a @ operands.b, GemmOperands(a, operands.b))
    assert 0 < len(guard.checkers) <= MAX_CHECKERS


@needs_ext
def test_a_signature_tells_apart_what_the_python_layouts_tell_apart():
    """The extension's layouts (one call) key a check as each tensor's shape, strides, dtype
    and device read apart do: two checks share a signature exactly where those agree, and a
    check of anything but tensors has none."""
    config = ABFTConfig()
    a, b, bias = torch.randn(8, 4), torch.randn(6, 4).t(), torch.randn(6)
    c = a @ b + bias
    cases = [
        (c, GemmOperands(a, b, 1.0, bias)),
        (c, GemmOperands(a, b.contiguous(), 1.0, bias)),  # the same shape, other strides
        (c, GemmOperands(a, b, 1.0, None)),
        (c, GemmOperands(a, b, 1.0, bias.double())),
        (c, GemmOperands(a, b, 0.5, bias)),
        (c.double(), GemmOperands(a.double(), b.double(), 1.0, bias.double())),
        (c[None], GemmOperands(a[None], b, 1.0, bias)),
        (c.clone(), GemmOperands(a.clone(), b.clone().t().contiguous().t(), 1.0, bias.clone())),
    ]
    fast = [signature(out, ops, None, config, False) for out, ops in cases]
    with compiled.disabled():  # the layouts read apart, as under torch.compile
        apart = [signature(out, ops, None, config, False) for out, ops in cases]
    for one, one_apart in zip(fast, apart, strict=True):
        for other, other_apart in zip(fast, apart, strict=True):
            assert (one == other) == (one_apart == other_apart)
    assert fast[0] == fast[-1] and len(set(fast)) == len(cases) - 1  # the same layouts
    assert signature(c, GemmOperands(a.tolist(), b, 1.0, bias), None, config, False) is None
    assert signature(c, GemmOperands(a, b, 1.0, 3.0), None, config, False) is None


@needs_ext
def test_bad_operands_are_still_explained_after_a_checker_is_chosen():
    operands, c = gemm(torch.float32, (2,), 64, 48, False, seed=1)
    guard = compiled_guard(operands, c, ABFTConfig(block_size=16))
    wrong = GemmOperands(operands.a[..., :8], operands.b)
    with pytest.raises(ValueError, match="inner dimensions differ"):
        guard.check(c.clone(), wrong)


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_sides_a_screen_takes_are_the_same_compiled(dtype):
    """The fused softmax screens the scores against screen_sides: the reference's on the first
    call of a signature, the compiled checker's after, equal."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 3, 40, 16, generator=g).to(dtype)  # [b, groups, heads a group, s, hn]
    k = torch.randn(2, 2, 1, 40, 16, generator=g).to(dtype)
    operands = GemmOperands(q, k.mT, 0.25)
    scores = (0.25 * q.double() @ k.mT.double()).to(dtype)
    guard = SectionGuard("scores", ABFTConfig(block_size=16), 0)
    by_reference = guard.screen_sides(scores, operands)
    (checker,) = guard.checkers.values()
    assert isinstance(checker, CompiledChecker)
    compiled_sides = guard.screen_sides(scores, operands)
    assert by_reference[:2] == compiled_sides[:2] and by_reference[4:] == compiled_sides[4:]
    for side in (2, 3):
        assert len(by_reference[side]) == len(compiled_sides[side]) == 2
        for one, other in zip(by_reference[side], compiled_sides[side], strict=True):
            assert torch.equal(one, other)


@needs_ext
def test_the_host_benchmark_times_a_compiled_check_and_its_ops_alone(tmp_path):
    """tools/bench_host.py runs the ops of a compiled checker by hand: it stays in step with
    them."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "host.json"
    tool = [sys.executable, "-m", "tools.bench_host", "--layers", "2", "--calls", "0.1"]
    subprocess.run(
        [*tool, "--out", out],
        check=True,
        capture_output=True,
        cwd=Path(__file__).parents[2],  # the repository root, where the tools run from
    )
    result = json.loads(out.read_text())
    assert result["device"] == "cpu"
    assert set(result["clean_check"]) == {
        "check",
        "ops_alone",
        "check_cold",
        "ops_alone_cold",
        "gemm_cold",
    }
    assert all(0 < t < 1 for t in result["clean_check"].values())
    if compiled.emulator_available():  # the GPU's route, a 2-D check on one scratch tensor
        assert result["sync_free_check_calls"] == {"aten_calls": 7, "tensors": 7}
    step = result["per_step"]
    assert step["layers"] == 2 and step["modules"] > 10
    assert 0 < step["set_step"] < 1 and 0 < step["finish_step"] < 1
    # the flash call's launches, counted on the CPU: the unchecked call's four kernels (forward,
    # Delta, dK/dV, dQ); the checked one's checksum launch (K's column sums and V's row sums;
    # the backward's ride on Delta's launch) and second launches besides, the ledger updated by
    # the last of them
    flash = result["flash_call"]
    assert flash["unchecked"]["launches"] == 4
    assert flash["checked"]["launches"] == 4 + 1 + 3
    assert all(0 < row["host"] < 1 and 0 < row["binder"] < 1 for row in flash.values())
    assert flash["checked"]["bound"] == flash["unchecked"]["bound"] + 1  # not the second ones


@pytest.mark.parametrize("gpu", TARGETS)
@pytest.mark.parametrize("larger", ["input", "weight"])
def test_on_cuda_a_projection_of_many_blocks_takes_the_compiled_checker(gpu, larger):
    """Operands of more than 8 blocks each (more than the 16 vectors of a kind that the CUDA
    products kernel holds a pass) are checked by the compiled ops on CUDA, which correct what the
    reference corrects: GPT-3 350M's qkv at micro-batch 8 (3072 outputs, blocks of 256) in
    small."""
    m, n = (300, 200) if larger == "input" else (200, 300)  # blocks of 16: 19 and 13
    operands, clean = gemm(torch.bfloat16, (), m, n, True, seed=7)
    config = ABFTConfig(block_size=16)
    c = clean.clone()
    inject_(c, TensorFault("value", "0d", value=1e4, seed=3))
    want, reference = c.clone(), SectionGuard("proj", config, 0)
    assert not bool(
        ReferenceChecker(config, True).run(want, operands, None, reference.ledger_on(c.device))
    )
    d = gpu.device
    on = GemmOperands(operands.a.to(d), operands.b.to(d), 0.5, operands.bias.to(d))
    got, guard = c.to(d), SectionGuard("proj", config, 0)
    with gpu.kernels():
        plan = choose(got, on, None, config, sync_free=True)
        assert isinstance(plan, CompiledChecker)
        failed = plan.settle(got, on, None, guard.ledger_on(d))
    assert not bool(failed)
    assert torch.equal(bits(got.cpu()), bits(want))
    assert guard.ledger.counts[1].sum() == 1  # one matrix corrected
    for name in ("counts", "logged"):
        assert torch.equal(getattr(guard.ledger, name).cpu(), getattr(reference.ledger, name))
    # the event's magnitude is a difference of sums the CUDA kernels round in their own order
    torch.testing.assert_close(guard.ledger.log.cpu(), reference.ledger.log, rtol=1e-6, atol=0)
