"""A guard's planned checks (megatron_abft.check.plan) against its general path: the same output,
bit for bit, the same ledger and the same verdict, for every fault; planned afresh for any change of
layout or setting; bad input still explained."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_ext import DTYPES, PROPERTY, corrupted, gemm_case, needs_ext
from test_ext_correct import bits

from megatron_abft.check.checksum import encode
from megatron_abft.check.eec import GemmOperands
from megatron_abft.check.plan import GENERAL, CheckPlan, signature
from megatron_abft.config import ABFTConfig
from megatron_abft.faults import TensorFault, inject_
from megatron_abft.ops import compiled
from megatron_abft.runtime.guard import MAX_PLANS, SectionGuard


def gemm(dtype, batch, m, n, bias, seed, weight=True):
    """A GEMM's operands (alpha 0.5) and its output, computed in fp32 (fp64) and rounded once.
    ``weight``: b is a transposed weight, as the linear layers give it, else stored row by
    row (where b is the larger operand, encode_pair then does not take it, a column-major
    operand, and nothing is planned)."""
    a, b, bias_t, _ = gemm_case(dtype, batch, m, 16, n, seed, bias)
    if weight:
        b = b.mT.contiguous().mT
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    c = 0.5 * (a.to(wide) @ b.to(wide)) + (0 if bias_t is None else bias_t.to(wide))
    return GemmOperands(a, b, 0.5, bias_t), c.to(dtype)


def planned_guard(operands, c, config, refs=None, plannable=True) -> SectionGuard:
    """A guard that has checked ``c`` clean once, and so planned its signature (if
    ``plannable``, with the compiled ops alone)."""
    guard = SectionGuard("proj", config, 0)
    assert guard._verify(c.clone(), operands, refs) is None
    plan = guard.plans[signature(c, operands, refs, config, False)]
    assert plan is not None or not plannable
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
def test_a_planned_check_equals_the_general_path(
    dtype, batch, m, n, block, bias, given_refs, weight, layout, kind, pattern, seed
):
    operands, clean = gemm(dtype, batch, m, n, bias, seed, weight)
    clean = corrupted(clean, "none", pattern, layout, seed)  # in the layout under test
    refs = None
    if given_refs:
        refs = encode(operands.a, operands.b, alpha=0.5, bias=operands.bias, block=block)
    config = ABFTConfig(block_size=block)
    planned = planned_guard(operands, clean, config, refs, plannable=given_refs)
    general = SectionGuard("proj", config, 0)
    c = corrupted(clean.clone(), kind, pattern, "contiguous", seed)  # clone keeps the layout
    c_general = c.clone()
    failed = planned._verify(c, operands, refs)
    want = general._general(c_general, operands, refs, general.ledger_on(c.device), False)
    assert torch.equal(bits(c), bits(c_general))
    assert (failed is None) == (want is None)
    if want is not None:
        assert torch.equal(failed, want)
    assert_same_ledger(planned.ledger, general.ledger)


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fault", ["0d", "row", "2d"])
def test_a_sync_free_plan_tallies_in_its_op_what_the_host_plan_tallies(dtype, fault):
    """Sync-free (a GPU's default), the plan's verify_correct_tally settles and tallies in one
    op; where a check may read the host it reads the verdict, and hands a matrix the kernels
    could not settle to the general path (GENERAL), which the sync-free plan counts
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
        plan = CheckPlan.make(c, operands, None, config, sync_free)
        guard = SectionGuard("proj", config, 0)
        out = c.clone()
        results[sync_free] = plan.run(out, operands, None, guard.ledger_on(c.device)), out, guard
    (failed, out, guard), (verdict, host_out, host_guard) = results[True], results[False]
    if fault == "2d":
        assert verdict is GENERAL
        assert bool(failed)
        assert torch.equal(bits(out), bits(faulty))
        assert guard.ledger.counts[2].sum() == 1  # one matrix uncorrectable
        return
    assert not bool(failed) and not bool(verdict)
    assert torch.equal(bits(out), bits(host_out))
    assert_same_ledger(guard.ledger, host_guard.ledger)
    assert guard.ledger.counts[1].sum() == 1  # one matrix corrected


@needs_ext
def test_a_changed_layout_or_setting_is_planned_afresh():
    operands, c = gemm(torch.float32, (2,), 64, 48, False, seed=1)
    config = ABFTConfig(block_size=16)
    guard = planned_guard(operands, c, config)
    config.threshold_scale = 4.0
    guard.check(c.clone(), operands)
    assert len(guard.plans) == 2
    (old, new) = guard.plans.values()
    assert new.bounds[0][0] == 4 * old.bounds[0][0]  # the thresholds scale
    with compiled.disabled():  # the PyTorch path: nothing to plan
        guard.check(c.clone(), operands)
    assert len(guard.plans) == 3 and list(guard.plans.values())[-1] is None
    for rows in range(3, 3 + MAX_PLANS):  # shapes that keep changing: a bounded cache
        a = torch.randn(2, rows, 16)
        guard.check(a @ operands.b, GemmOperands(a, operands.b))
    assert 0 < len(guard.plans) <= MAX_PLANS


@needs_ext
def test_bad_operands_are_still_explained_after_a_plan():
    operands, c = gemm(torch.float32, (2,), 64, 48, False, seed=1)
    guard = planned_guard(operands, c, ABFTConfig(block_size=16))
    wrong = GemmOperands(operands.a[..., :8], operands.b)
    with pytest.raises(ValueError, match="inner dimensions differ"):
        guard.check(c.clone(), wrong)


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_sides_a_screen_takes_are_the_same_planned(dtype):
    """The fused softmax screens the scores against screen_sides: the general path's on the
    first call of a signature, the plan's after, equal."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 3, 40, 16, generator=g).to(dtype)  # [b, groups, heads a group, s, hn]
    k = torch.randn(2, 2, 1, 40, 16, generator=g).to(dtype)
    operands = GemmOperands(q, k.mT, 0.25)
    scores = (0.25 * q.double() @ k.mT.double()).to(dtype)
    guard = SectionGuard("scores", ABFTConfig(block_size=16), 0)
    general = guard.screen_sides(scores, operands)
    assert len(guard.plans) == 1 and None not in guard.plans.values()
    planned = guard.screen_sides(scores, operands)
    assert general[:2] == planned[:2] and general[4:] == planned[4:]  # blocks and bounds
    for side in (2, 3):
        assert len(general[side]) == len(planned[side]) == 2
        for one, other in zip(general[side], planned[side], strict=True):
            assert torch.equal(one, other)


@needs_ext
def test_the_host_benchmark_times_a_planned_check_and_its_ops_alone(tmp_path):
    """tools/bench_host.py runs the ops of a planned check by hand: it stays in step with them."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "host.json"
    subprocess.run(
        [sys.executable, "-m", "tools.bench_host", "--layers", "2", "--out", str(out)],
        check=True,
        capture_output=True,
        cwd=Path(__file__).parents[2],  # the repository root, where the tools run from
    )
    result = json.loads(out.read_text())
    assert result["device"] == "cpu"
    assert set(result["clean_check"]) == {"check", "ops_alone"}
    assert all(0 < t < 1 for t in result["clean_check"].values())
    step = result["per_step"]
    assert step["layers"] == 2 and step["modules"] > 10
    assert 0 < step["set_step"] < 1 and 0 < step["finish_step"] < 1
