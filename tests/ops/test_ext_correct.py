"""The compiled verify-and-correct (megatron_abft::verify_correct, csrc/kernels/abft_correct.h)
against the PyTorch path of eec.py: through verify_and_correct, and the op alone as a sync-free
check on a GPU runs it."""

import pytest
import torch
from cuda_targets import TARGETS
from hypothesis import example, given
from hypothesis import strategies as st
from test_ext import (
    DTYPES,
    PROPERTY,
    assert_same_result,
    corrupted,
    gemm_case,
    needs_ext,
)

from megatron_abft.check.checksum import encode
from megatron_abft.check.eec import (
    CLEAN,
    CORRECTED,
    UNCORRECTABLE,
    GemmOperands,
    _kernel_check,
    residuals,
    verify_and_correct,
)
from megatron_abft.check.sides import Check
from megatron_abft.check.tolerance import gemm_rounding
from megatron_abft.faults import TensorFault, inject_
from megatron_abft.ops import compiled


def case(dtype, batch, m, n, block, bias, sides, seed):
    """A GEMM output with its references on ``sides`` and its operands (alpha 0.5). C is the
    product in fp32 (fp64) rounded once to ``dtype``, as a recomputed element is: a CPU GEMM in
    bf16 may round partial sums too, and differ from it by more than one rounding."""
    a, b, bias_t, _ = gemm_case(dtype, batch, m, 16, n, seed, bias)
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    c = 0.5 * (a.to(wide) @ b.to(wide)) + (0 if bias_t is None else bias_t.to(wide))
    c = c.to(dtype)
    col, row = encode(a, b, alpha=0.5, bias=bias_t, block=block)
    refs = {name: ref for name, ref in (("col", col), ("row", row)) if name in sides}
    return c, refs, GemmOperands(a, b, 0.5, bias_t)


def recompute_tolerance(dtype: torch.dtype) -> dict:
    """How far two recomputations of an element of a case (k = 16) may differ: the order of
    an fp32 (fp64) sum of 16 products, then one rounding to ``dtype`` apart."""
    accumulation = torch.float64 if dtype == torch.float64 else torch.float32
    return {"rtol": 2 * torch.finfo(dtype).eps, "atol": 64 * torch.finfo(accumulation).eps}


def op_alone(c, refs, operands, capacity=None):
    """The kernels' verify-and-correct by itself: (status, kind, row, col, magnitude)."""
    capacity = capacity or max(c.shape[-2:])
    check = Check(gemm_rounding(c.dtype, c.device), 1.0, 1e10, capacity, operands)
    return _kernel_check(c, refs, check)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits, so that NaN payloads compare too."""
    sizes = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}
    return t.contiguous().view(sizes[t.element_size()])


@needs_ext
@PROPERTY
@given(
    dtype=st.sampled_from(DTYPES),
    batch=st.sampled_from([(), (2,), (2, 3)]),
    m=st.integers(2, 200),
    n=st.integers(2, 200),
    block=st.sampled_from([2, 16, 64, 256]),
    bias=st.booleans(),
    sides=st.sampled_from([("col",), ("row",), ("col", "row")]),
    layout=st.sampled_from(["contiguous", "column-major"]),
    kind=st.sampled_from(["inf", "-inf", "nan", "near_inf", "value", "bitflip", "none"]),
    pattern=st.sampled_from(["0d", "row", "col", "2d"]),
    seed=st.integers(0, 2**16),
)
@example(torch.bfloat16, (2, 3), 200, 150, 64, True, ("col", "row"), "contiguous", "nan", "row", 1)
@example(torch.float16, (2,), 130, 90, 16, False, ("col",), "column-major", "value", "col", 2)
@example(torch.float32, (), 96, 120, 32, True, ("col",), "contiguous", "nan", "0d", 3)
@example(torch.bfloat16, (), 64, 80, 16, False, ("col", "row"), "contiguous", "nan", "2d", 4)
def test_verify_and_correct_with_the_kernels_equals_the_pytorch_path(
    dtype, batch, m, n, block, bias, sides, layout, kind, pattern, seed
):
    c, refs, operands = case(dtype, batch, m, n, block, bias, sides, seed)
    c = corrupted(c, kind, pattern, layout, seed)
    fused_c, torch_c = c.clone(), c.clone()
    fused = verify_and_correct(fused_c, **refs, operands=operands, check_references=False)
    with compiled.disabled():
        want = verify_and_correct(torch_c, **refs, operands=operands, check_references=False)
    assert_same_result(fused, want, pattern)
    assert torch.equal(fused_c.isnan(), torch_c.isnan())
    settled = fused.status != UNCORRECTABLE
    for side, ref in refs.items():  # what the kernels settled checks clean on the PyTorch path
        with compiled.disabled():
            flagged = residuals(fused_c, ref, side=side).flagged.flatten(-2).any(-1)
        assert not bool((flagged & settled).any())
    if kind != "bitflip":  # flips of low bits may stay below the thresholds, and the two paths
        # (budgets per call and per matrix) may leave different ones; both check clean (above)
        torch.testing.assert_close(fused_c, torch_c, equal_nan=True, **recompute_tolerance(dtype))


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sides", [("col",), ("col", "row")])
@pytest.mark.parametrize(
    "kind,pattern",
    [("value", "0d"), ("nan", "0d"), ("inf", "0d"), ("near_inf", "0d"), ("value", "row")]
    + [("nan", "col"), ("bitflip", "0d")],
)
def test_the_op_alone_corrects_0d_and_1d_faults(dtype, sides, kind, pattern):
    """A sync-free check on a GPU has no PyTorch path behind the op: 0D and 1D faults are
    settled by the op itself."""
    c, refs, operands = case(dtype, (2, 3), 150, 120, 64, True, sides, seed=7)
    faulty = c.clone()
    inject_(faulty, TensorFault(kind, pattern, value=1e4, batch_index=4, seed=7))
    status, found_kind, *_ = op_alone(faulty, refs, operands)
    expected = torch.zeros(6, dtype=torch.int8)
    expected[4] = CORRECTED
    assert torch.equal(status.flatten(), expected)
    if kind != "bitflip":  # a flipped bit may make any kind of value
        expected_kind = {"nan": 3, "inf": 2, "near_inf": 1}.get(kind, 0)
        if kind == "near_inf" and dtype == torch.float16:
            expected_kind = 2  # 1e10 overflows fp16
        assert int(found_kind.flatten()[4]) == expected_kind
    torch.testing.assert_close(faulty, c, **recompute_tolerance(dtype))


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES)
def test_what_the_op_cannot_settle_it_puts_back_bit_for_bit(dtype):
    c, refs, operands = case(dtype, (2,), 96, 80, 32, False, ("col", "row"), seed=3)
    c[1, 10:20, 10:20] = float("nan")  # a 2D fault
    before = bits(c).clone()
    assert int((c != c).sum()) > 4  # more flagged vectors than a capacity of 2 corrects
    status, *_ = op_alone(c, refs, operands, capacity=2)
    assert status.tolist() == [CLEAN, UNCORRECTABLE]
    assert torch.equal(bits(c), before)
    # verify_and_correct on CPU hands that matrix to the PyTorch path, which reports the same
    result = verify_and_correct(c, **refs, operands=operands, max_corrections=2)
    assert result.status.tolist() == [CLEAN, UNCORRECTABLE] and torch.equal(bits(c), before)


@needs_ext
def test_more_flagged_vectors_than_the_capacity_put_the_matrix_back():
    c, refs, operands = case(torch.float32, (3,), 64, 64, 32, False, ("col", "row"), seed=4)
    clean = c.clone()
    inject_(c, TensorFault("value", "row", value=1e4, batch_index=2, seed=4))
    before = bits(c).clone()
    status, *_ = op_alone(c.clone(), refs, operands, capacity=64)
    assert status.tolist() == [CLEAN, CLEAN, CORRECTED]
    out = c.clone()
    status, *_ = compiled.verify_correct(
        out, _sides(out, refs, operands), (operands.a, operands.b, 0.5, None), 1e10, 5
    )
    assert status.tolist() == [CLEAN, CLEAN, UNCORRECTABLE] and torch.equal(bits(out), before)
    # through verify_and_correct on CPU, the PyTorch path takes it
    result = verify_and_correct(c, **refs, operands=operands)
    assert result.status.tolist() == [CLEAN, CLEAN, CORRECTED]
    torch.testing.assert_close(c, clean, **recompute_tolerance(torch.float32))


def _sides(c, refs, operands):
    from megatron_abft.check.sides import kernel_sides

    return kernel_sides(c, refs, Check(gemm_rounding(c.dtype, c.device), 1.0, 1e10, 1, operands))


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_recomputed_values_round_to_the_dtype_as_torch_does(dtype):
    """Operands in fp32 and C in half precision: every element the op writes is its fp32
    value rounded to nearest even, as torch's conversion rounds it, subnormals and ties too."""
    g = torch.Generator().manual_seed(0)
    big = 60000.0 if dtype == torch.float16 else 1e30
    values = torch.cat(
        [
            (torch.randn(3000, generator=g) * torch.logspace(-7, 4.7, 3000)).clamp(-big, big),
            torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8, 1 + 3 * 2**-8, big]),  # ties
            -torch.rand(1000, generator=g) * 2**-14,  # fp16 subnormals
        ]
    )  # (a subnormal tie is off by exactly the threshold's floor: the screen sends it on)
    a = values.reshape(-1, 1, 1)  # [N, m=1, k=1]
    b = torch.ones(1, 1)
    c = torch.full((values.numel(), 1, 1), 7.0, dtype=dtype)  # every element wrong
    col = encode(a, b, block=2)[0]
    status, *_ = op_alone(c, {"col": col}, GemmOperands(a, b))
    assert bool((status == CORRECTED).all())
    assert torch.equal(bits(c), bits(values.to(dtype).reshape(c.shape)))


@needs_ext
def test_a_faulty_check_is_a_few_ops_with_the_kernels():
    c, refs, operands = case(torch.bfloat16, (2, 4), 128, 96, 32, False, ("col", "row"), seed=5)
    inject_(c, TensorFault("nan", "row", batch_index=3, seed=5))
    ops = {}
    for path in ("kernels", "torch"):
        out = c.clone()
        cpu = [torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=cpu, acc_events=True) as profile:
            if path == "kernels":
                verify_and_correct(out, **refs, operands=operands, check_references=False)
            else:
                with compiled.disabled():
                    verify_and_correct(out, **refs, operands=operands, check_references=False)
        ops[path] = sum(1 for e in profile.events() if e.cpu_parent is None and "::" in e.name)
        assert torch.isfinite(out).all()
    assert ops["kernels"] <= 30 and ops["torch"] > 10 * ops["kernels"], ops


@needs_ext
def test_verify_correct_opcheck():
    c, refs, operands = case(torch.float32, (2,), 40, 30, 16, True, ("col", "row"), seed=6)
    args = (c, *_sides(c, refs, operands), operands.a, operands.b, 0.5, operands.bias, 1e10, 64)
    torch.library.opcheck(torch.ops.megatron_abft.verify_correct.default, args)


@needs_ext
@pytest.mark.parametrize(
    "change,message",
    [
        ({"a": torch.randn(2, 41, 16)}, "do not produce c"),
        ({"b": torch.randn(3, 16, 30)}, "does not broadcast to the batch of c"),
        ({"bias": torch.randn(31)}, "bias must be"),
        ({"capacity": 0}, "capacity must be >= 1"),
        ({"a": torch.ones(2, 40, 16, dtype=torch.int32)}, "verify_correct: a must be fp32"),
    ],
)
def test_verify_correct_bad_inputs_raise_clear_errors(change, message):
    c, refs, operands = case(torch.float32, (2,), 40, 30, 16, False, ("col", "row"), seed=6)
    args = {"a": operands.a, "b": operands.b, "bias": None, "capacity": 64} | change
    with pytest.raises(RuntimeError, match=message):
        torch.ops.megatron_abft.verify_correct(
            c,
            *_sides(c, refs, operands),
            args["a"],
            args["b"],
            0.5,
            args["bias"],
            1e10,
            args["capacity"],
        )


@pytest.mark.parametrize("gpu", TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["contiguous", "column-major"])
def test_cuda_verify_correct_equals_the_cpu_op(dtype, layout, gpu):
    c, refs, operands = case(dtype, (2, 4), 256, 192, 64, True, ("col", "row"), seed=8)
    inject_(c, TensorFault("nan", "row", batch_index=5, seed=8))
    inject_(c, TensorFault("near_inf", "0d", batch_index=2, seed=9))
    inject_(c, TensorFault("value", "2d", value=1e4, batch_index=7, seed=9))
    c = corrupted(c, "none", "0d", layout, 0)
    cpu_c = c.clone()
    cpu = op_alone(cpu_c, refs, operands)
    a, b, bias = (t.to(gpu.device) for t in (operands.a, operands.b, operands.bias))
    gpu_c = c.to(gpu.device)
    with gpu.kernels():
        col, row = encode(a, b, alpha=0.5, bias=bias, block=64)
        gpu_refs, gpu_operands = {"col": col, "row": row}, GemmOperands(a, b, 0.5, bias)
        got = op_alone(gpu_c, gpu_refs, gpu_operands)
        args = (gpu_c.clone(), *_sides(gpu_c, gpu_refs, gpu_operands), a, b, 0.5, bias, 1e10, 64)
        torch.library.opcheck(torch.ops.megatron_abft.verify_correct.default, args)
    for x, want in zip(got[:2], cpu[:2], strict=True):
        assert torch.equal(x.cpu(), want)
    assert torch.equal(gpu_c.isnan().cpu(), cpu_c.isnan())
    torch.testing.assert_close(gpu_c.cpu(), cpu_c, equal_nan=True, **recompute_tolerance(dtype))


@needs_ext
def test_the_kernel_selftest_checks_the_correction(monkeypatch):
    from megatron_abft.ops.selftest import mismatches

    assert mismatches(torch.device("cpu")) == []

    def settles_nothing(c, *args):
        if not compiled.available():  # inside compiled.disabled(), as the real op
            return None
        return tuple(torch.zeros(c.shape[:-2], dtype=t) for t in (torch.int8,) * 2) + (
            torch.full(c.shape[:-2], -1),
            torch.full(c.shape[:-2], -1),
            torch.zeros(c.shape[:-2]),
        )

    monkeypatch.setattr(compiled, "verify_correct", settles_nothing)
    wrong = mismatches(torch.device("cpu"))
    assert "verify_correct, 0D and 1D (torch.float32)" in wrong
    assert "verify_correct, put back (torch.float32)" in wrong


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_difference_just_inside_the_threshold_is_clean_and_left_alone(dtype):
    """The screen flags a column whose difference lies between its tightened threshold and the
    reference's; the op finds it clean by the reference's threshold and writes nothing."""
    c = torch.zeros(1, 8, 3, dtype=dtype)
    c[0, 0, 1], c[0, 1, 1] = 1.0, -1.0  # column 1 sums to exactly 0, its weighted sum to -1
    eye = torch.eye(8, dtype=dtype).unsqueeze(0)
    col = encode(eye, c, block=8)[0]
    tau = residuals(c, col).tau[0, 0, 1]
    col.sums[0, 0, 0, 1] = tau * (1 - 2.0**-18)  # d1 just below tau, d2 = 0
    from megatron_abft.check.sides import screen

    operands = GemmOperands(eye, c.clone())
    check = Check(gemm_rounding(dtype, c.device), 1.0, 1e10, 8, operands)
    assert int(screen(c, {"col": col}, check)[0]) == 1
    before = c.clone()
    status, kind, row, col_index, magnitude = op_alone(c, {"col": col}, operands)
    assert status.tolist() == [CLEAN] and col_index.tolist() == [-1] and torch.equal(c, before)
    result = verify_and_correct(c, col, operands=operands)
    assert result.known_clean and torch.equal(c, before)


@needs_ext
def test_torch_compile_traces_verify_correct_and_keeps_its_correction():
    """The fake implementation and the schema's mutation of c let torch.compile trace the op in
    one graph (aot_eager: the same tracing as inductor, without its code generation), and the
    compiled call corrects c in place as the eager one does."""
    c, refs, operands = case(torch.float32, (2, 3), 64, 48, 16, True, ("col", "row"), seed=9)
    inject_(c, TensorFault("nan", "0d", batch_index=4, seed=9))
    sides = _sides(c, refs, operands)

    def check(out):
        return torch.ops.megatron_abft.verify_correct(
            out, *sides, operands.a, operands.b, 0.5, operands.bias, 1e10, 64
        )

    eager_c, compiled_c = c.clone(), c.clone()
    eager = check(eager_c)
    torch._dynamo.reset()
    compiled = torch.compile(check, backend="aot_eager", fullgraph=True)(compiled_c)
    for got, want in zip(compiled, eager, strict=True):  # magnitude is NaN for a NaN fault
        assert torch.equal(bits(got), bits(want))
    assert int((eager[0] == CORRECTED).sum()) == 1 and torch.isfinite(compiled_c).all()
    assert torch.equal(compiled_c, eager_c)


@needs_ext
@pytest.mark.parametrize("section", ["scores", "context"])
@pytest.mark.parametrize("pattern", ["0d", "row", "col"])
def test_the_attention_layouts_equal_the_pytorch_path(section, pattern):
    """The operands as the protected attention passes them: [b, groups, heads per group, ...],
    K and V shared by a group's heads (batch dims that broadcast), K^T column-major; C a view of
    a strided batch."""
    g = torch.Generator().manual_seed(11)
    q = torch.randn(10, 2, 6, 32, generator=g).bfloat16()  # [s, b, heads, d]
    k = torch.randn(10, 2, 2, 32, generator=g).bfloat16()  # [s, b, groups, d]
    q5 = q.reshape(10, 2, 2, 3, 32).permute(1, 2, 3, 0, 4)  # [b, groups, 3, s, d]
    k5 = k.permute(1, 2, 0, 3).unsqueeze(2)  # [b, groups, 1, s, d]
    if section == "scores":
        a, b, alpha = q5, k5.mT, 0.125
    else:
        a, b, alpha = torch.softmax(q5.float() @ k5.mT.float(), -1).bfloat16(), k5, 1.0
    c = (alpha * (a.float() @ b.float())).bfloat16()
    col, row = encode(a, b, alpha=alpha, block=4)
    inject_(c, TensorFault("value", pattern, value=50.0, batch_index=7, seed=3))
    operands = GemmOperands(a, b, alpha)
    fused_c, torch_c = c.clone(), c.clone()
    fused = verify_and_correct(fused_c, col, row, operands=operands)
    with compiled.disabled():
        want = verify_and_correct(torch_c, col, row, operands=operands)
    assert torch.equal(fused.status, want.status) and torch.equal(fused.counts, want.counts)
    assert int((fused.status == CORRECTED).sum()) == 1
    torch.testing.assert_close(fused_c, torch_c, **recompute_tolerance(torch.bfloat16))
    status, *_ = op_alone(c.clone(), {"col": col, "row": row}, operands)
    assert torch.equal(status, fused.status)
