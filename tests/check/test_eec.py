"""EEC-ABFT on random GEMM outputs: correction, never-silent, no false alarms, bad input."""

import math
from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from megatron_abft.check.checksum import encode
from megatron_abft.check.eec import (
    CLEAN,
    CORRECTED,
    KINDS,
    UNCORRECTABLE,
    GemmOperands,
    report,
    residuals,
    verify_and_correct,
)
from megatron_abft.check.tolerance import unit_roundoff
from megatron_abft.faults import TensorFault, inject_

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
PROPERTY = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@dataclass
class Gemm:
    a: torch.Tensor
    b: torch.Tensor
    alpha: float
    bias: torch.Tensor | None
    block: int
    c: torch.Tensor  # torch's own result in the data dtype: the fault-free output

    @property
    def operands(self) -> GemmOperands:
        return GemmOperands(self.a, self.b, self.alpha, self.bias)

    def exact(self) -> torch.Tensor:
        c = self.alpha * (self.a.double() @ self.b.double())
        return c if self.bias is None else c + self.bias.double()

    def checksums(self):
        return encode(self.a, self.b, alpha=self.alpha, bias=self.bias, block=self.block)


sizes = st.one_of(st.integers(1, 48), st.integers(49, 2048))


@st.composite
def gemms(draw, max_elements=2**22):
    dtype = draw(st.sampled_from(DTYPES))
    m, n = draw(sizes), draw(sizes)
    assume(m * n <= max_elements)
    k = draw(st.integers(1, 96))
    batch = draw(st.sampled_from([(), (2,), (2, 3)]))
    block = draw(st.sampled_from([2, 16, 64, 256, 1024]))
    alpha = draw(st.sampled_from([1.0, 0.125, -2.0]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    a = torch.randn(*batch, m, k, generator=g).to(dtype)
    b = torch.randn(k, n, generator=g).to(dtype)  # shared across the batch, as K under GQA
    bias = torch.randn(n, generator=g).to(dtype) if draw(st.booleans()) else None
    return make_gemm(a, b, alpha, bias, block)


def make_gemm(a, b, alpha=1.0, bias=None, block=256) -> Gemm:
    """C as a Megatron layer computes it: the product, then the bias added in the data dtype."""
    c = alpha * (a @ b) + (0 if bias is None else bias)
    return Gemm(a, b, alpha, bias, block, c.to(a.dtype))


def extreme_shape(dtype, m, k, n) -> Gemm:
    g = torch.Generator().manual_seed(m + n)
    return make_gemm(
        torch.randn(m, k, generator=g).to(dtype), torch.randn(k, n, generator=g).to(dtype)
    )


def largest_threshold(gemm: Gemm) -> float:
    col, row = gemm.checksums()
    return max(
        residuals(gemm.c, col).tau.max().item(), residuals(gemm.c, row, side="row").tau.max().item()
    )


def detectable_fault(gemm: Gemm, kind: str, pattern: str, seed: int) -> TensorFault:
    """A fault whose every corrupted element is well above the detection threshold."""
    m, n = gemm.c.shape[-2:]
    g = torch.Generator().manual_seed(seed)
    position = (int(torch.randint(m, (1,), generator=g)), int(torch.randint(n, (1,), generator=g)))
    batch_index = int(torch.randint(gemm.c.numel() // (m * n), (1,), generator=g))
    if kind == "value":
        big = 4 * largest_threshold(gemm) + 2 * gemm.c.abs().max().item() + 1
        return TensorFault(
            "value",
            pattern,
            value=-big if seed % 2 else big,
            position=position,
            batch_index=batch_index,
            seed=seed,
        )
    if kind == "bitflip":  # the exponent bit that makes this element huge
        x = gemm.c.reshape(-1, m, n)[batch_index][position].item()
        assume(x != 0)
        bits = torch.finfo(gemm.c.dtype).bits
        bit = bits - 2 if abs(x) < 2 else bits - 3
        return TensorFault("bitflip", pattern, bit=bit, position=position, batch_index=batch_index)
    return TensorFault(kind, pattern, position=position, batch_index=batch_index, seed=seed)


def identical(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Equal element for element, NaN included."""
    return torch.equal(torch.isnan(x), torch.isnan(y)) and torch.equal(
        x.nan_to_num(), y.nan_to_num()
    )


def assert_within_flash_rule(out: torch.Tensor, gemm: Gemm) -> None:
    """FlashAttention's rule: error <= 2x that of torch's same-precision result (fp64 reference)."""
    exact = gemm.exact()
    assert torch.isfinite(out).all()
    err = (out.double() - exact).abs().max().item()
    torch_err = (gemm.c.double() - exact).abs().max().item()
    slack = unit_roundoff(gemm.c.dtype) * exact.abs().max().item()
    assert err <= 2 * torch_err + slack, (err, torch_err)


def expected_kind(kind: str, dtype: torch.dtype) -> str | None:
    if kind in ("inf", "-inf"):
        return "inf"
    if kind == "nan":
        return "nan"
    if kind == "near_inf":
        return "inf" if dtype == torch.float16 else "near_inf"
    return None


@settings(PROPERTY, max_examples=200)
@given(
    gemm=gemms(),
    kind=st.sampled_from(["inf", "-inf", "nan", "near_inf", "value", "bitflip"]),
    pattern=st.sampled_from(["0d", "row", "col"]),
    seed=st.integers(0, 2**16),
)
@example(gemm=extreme_shape(torch.float32, 1, 1, 1), kind="nan", pattern="0d", seed=0)
@example(gemm=extreme_shape(torch.float32, 2048, 64, 2048), kind="inf", pattern="row", seed=1)
@example(gemm=extreme_shape(torch.bfloat16, 2048, 64, 2048), kind="near_inf", pattern="col", seed=2)
@example(gemm=extreme_shape(torch.float16, 2048, 64, 2048), kind="bitflip", pattern="0d", seed=3)
def test_detectable_faults_are_corrected_to_the_fault_free_output(gemm, kind, pattern, seed):
    assume(kind != "bitflip" or pattern == "0d")
    fault = detectable_fault(gemm, kind, pattern, seed)
    out = gemm.c.clone()
    hit = inject_(out, fault)
    col, row = gemm.checksums()
    result = verify_and_correct(out, col, row, operands=gemm.operands)

    assert_within_flash_rule(out, gemm)
    status = result.status.reshape(-1)
    assert status[hit.batch_index] == CORRECTED
    assert (status[torch.arange(status.numel()) != hit.batch_index] == CLEAN).all()
    counts = report(result)
    assert sum(counts["detected"].values()) == sum(counts["corrected"].values()) == 1
    assert sum(counts["uncorrectable"].values()) == 0
    if expected_kind(kind, gemm.c.dtype):
        assert counts["corrected"][expected_kind(kind, gemm.c.dtype)] == 1


@PROPERTY
@given(
    gemm=gemms(max_elements=2**18),
    kind=st.sampled_from(["inf", "nan", "near_inf", "value"]),
    pattern=st.sampled_from(["0d", "row", "col"]),
    seed=st.integers(0, 2**16),
)
def test_without_operands_the_checksum_rebuilds_within_the_threshold(gemm, kind, pattern, seed):
    out = gemm.c.clone()
    hit = inject_(out, detectable_fault(gemm, kind, pattern, seed))
    col, row = gemm.checksums()
    result = verify_and_correct(out, col, row)
    assert result.status.reshape(-1)[hit.batch_index] == CORRECTED
    assert torch.isfinite(out).all()
    error = (out.double() - gemm.c.double()).abs().max().item()
    assert (
        error <= largest_threshold(gemm) + unit_roundoff(gemm.c.dtype) * gemm.c.abs().max().item()
    )


@PROPERTY
@given(
    gemm=gemms(max_elements=2**18),
    pattern=st.sampled_from(["0d", "row", "col"]),
    seed=st.integers(0, 2**16),
)
def test_random_bitflips_are_corrected_and_leave_no_error_above_the_threshold(gemm, pattern, seed):
    """A random bit flipped in one element, or the same bit along a whole row or column (each
    element then changes by its own amount, some below the detection limit): with the operands,
    corrected whenever detected (but, rarely, in fp16 and bf16: docs/abft.md §4), and what is
    left (undetected, or too small for either side to see beside what was corrected) sums, per
    checked vector, to less than its threshold."""
    out = gemm.c.clone()
    hit = inject_(out, TensorFault("bitflip", pattern, seed=seed))
    faulty = out.clone()
    col, row = gemm.checksums()
    result = verify_and_correct(out, col, row, operands=gemm.operands)
    b = hit.batch_index
    if result.status.reshape(-1)[b] == UNCORRECTABLE:
        assert gemm.c.dtype != torch.float32
        assert identical(out, faulty)
        return
    counts = report(result)
    assert sum(counts["detected"].values()) == sum(counts["corrected"].values()) <= 1
    # whatever was left uncorrected sums, per checked vector, to less than its threshold
    m, n = out.shape[-2:]
    error = (out.double() - gemm.c.double()).reshape(-1, m, n)[b]
    for side, ref, err in (("col", col, error), ("row", row, error.mT)):
        tau = residuals(out, ref, side=side).tau.reshape(
            -1, *ref.sums.shape[-3:-2], ref.sums.shape[-1]
        )[b]
        padded = torch.nn.functional.pad(err, (0, 0, 0, tau.shape[0] * ref.block - err.shape[0]))
        per_vector = padded.unflatten(0, (-1, ref.block)).sum(1).abs()
        assert (per_vector <= 2 * tau.double() + 1e-30).all()


@PROPERTY
@given(
    gemm=gemms(max_elements=2**18),
    kind=st.sampled_from(["inf", "nan", "near_inf", "value"]),
    seed=st.integers(0, 2**16),
)
def test_2d_faults_are_never_silent_and_never_corrected_into_wrong_values(gemm, kind, seed):
    m, n = gemm.c.shape[-2:]
    assume(m >= 2 and n >= 2)
    out = gemm.c.clone()
    fault = replace(detectable_fault(gemm, kind, "0d", seed), pattern="2d", position=None)
    hit = inject_(out, fault)
    faulty = out.clone()
    col, row = gemm.checksums()
    result = verify_and_correct(out, col, row, operands=gemm.operands)
    status = result.status.reshape(-1)[hit.batch_index]
    assert status != CLEAN
    if status == UNCORRECTABLE:  # left exactly as it was, and counted
        assert identical(out, faulty)
        assert sum(report(result)["uncorrectable"].values()) == 1
    else:  # recomputed from the operands: exact again
        assert_within_flash_rule(out, gemm)


def small_gemm(dtype=torch.float32, m=40, k=16, n=30, block=16, seed=0) -> Gemm:
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(3, m, k, generator=g).to(dtype), torch.randn(3, k, n, generator=g).to(dtype)
    return Gemm(a, b, 1.0, None, block, a @ b)


def test_without_operands_a_2d_fault_inside_one_block_is_uncorrectable_and_left_untouched():
    gemm = small_gemm()
    out = gemm.c.clone()
    inject_(out, TensorFault("inf", "2d", position=(2, 3), block=(3, 2), batch_index=1))
    faulty = out.clone()
    result = verify_and_correct(out, *gemm.checksums())
    assert result.status.tolist() == [CLEAN, UNCORRECTABLE, CLEAN]
    assert report(result)["uncorrectable"]["inf"] == 1
    assert identical(out, faulty)


@pytest.mark.parametrize("kind", ["inf", "value"])
@pytest.mark.parametrize(
    "position, block",
    [((2, 3), (2, 2)), ((2, 3), (3, 2)), ((33, 17), (2, 2))],  # the last in both short blocks
)
def test_with_operands_a_2d_fault_inside_one_block_is_recomputed(kind, position, block):
    """The flagged rows and columns cross each other twice or more, so no element is located:
    their whole blocks are recomputed, in a strided view, writing nothing outside it."""
    gemm = small_gemm()
    big = torch.zeros(3, 50, 50)
    view = big[:, 5:45, 2:32]  # a strided [3, 40, 30] view holding C
    view.copy_(gemm.c)
    fault = TensorFault(kind, "2d", value=1e3, position=position, block=block, batch_index=1)
    inject_(view, fault)
    result = verify_and_correct(view, *gemm.checksums(), operands=gemm.operands)
    assert result.status.tolist() == [CLEAN, CORRECTED, CLEAN]
    counts = report(result)
    assert sum(counts["detected"].values()) == sum(counts["corrected"].values()) == 1
    assert_within_flash_rule(view, gemm)
    big[:, 5:45, 2:32] = 0
    assert not big.any()


@pytest.mark.parametrize(
    "dtype, bit", [(torch.float32, 12), (torch.bfloat16, 4), (torch.float16, 4)]
)
@pytest.mark.parametrize("pattern", ["row", "col"])
def test_with_operands_a_row_or_column_of_bitflips_is_corrected_exactly(dtype, bit, pattern):
    """The same mantissa bit flipped in every element of a row (column) changes each by its own
    amount: the column (row) checks flag some elements, the others stay below their detection
    limit. All are corrected, as one detection and one correction."""
    gemm = small_gemm(dtype)
    out = gemm.c.clone()
    inject_(out, TensorFault("bitflip", pattern, bit=bit, position=(5, 7), batch_index=1))
    col, row = gemm.checksums()
    across = (
        residuals(out, col, side="col") if pattern == "row" else residuals(out, row, side="row")
    )
    flagged = across.flagged[1, 0].sum().item()  # the crossing vectors, in the fault's block
    assert 0 < flagged < gemm.c.shape[-1 if pattern == "row" else -2]
    result = verify_and_correct(out, col, row, operands=gemm.operands)
    assert result.status.tolist() == [CLEAN, CORRECTED, CLEAN]
    counts = report(result)
    assert counts["detected"]["finite"] == counts["corrected"]["finite"] == 1
    assert sum(counts["detected"].values()) == sum(counts["corrected"].values()) == 1
    assert_within_flash_rule(out, gemm)


@pytest.mark.parametrize("corrupt", ["plain", "weighted", "both", "nan"])
@pytest.mark.parametrize("side", ["col", "row"])
def test_a_corrupted_checksum_is_uncorrectable_and_the_output_is_left_alone(corrupt, side):
    gemm = small_gemm(seed=1)
    col, row = gemm.checksums()
    ref = col if side == "col" else row
    sums = ref.sums.clone()
    delta = 50.0
    if corrupt in ("plain", "both"):
        sums[1, 0, 0, 5] += delta
    if corrupt in ("weighted", "both"):
        sums[1, 0, 1, 5] += 3 * delta  # as if element 2 of the block were off by delta
    if corrupt == "nan":
        sums[1, 0, 0, 5] = math.nan
    bad = replace(ref, sums=sums)
    out = gemm.c.clone()
    args = (bad, row) if side == "col" else (col, bad)
    result = verify_and_correct(out, *args, check_references=False)
    assert result.status.tolist() == [CLEAN, UNCORRECTABLE, CLEAN]
    assert torch.equal(out, gemm.c)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("side", ["col", "row"])
@pytest.mark.parametrize("kind", ["inf", "nan", "near_inf"])
def test_one_side_alone_corrects_an_extreme_0d_fault(dtype, side, kind):
    gemm = small_gemm(dtype, m=70, n=90, block=32)
    out = gemm.c.clone()
    inject_(out, TensorFault(kind, "0d", position=(33, 61), batch_index=2))
    col, row = gemm.checksums()
    result = verify_and_correct(
        out, col if side == "col" else None, row if side == "row" else None, operands=gemm.operands
    )
    assert result.status.tolist() == [CLEAN, CLEAN, CORRECTED]
    assert_within_flash_rule(out, gemm)


@pytest.mark.parametrize("with_operands", [True, False])
def test_more_faulty_vectors_than_the_capacity_are_uncorrectable(with_operands):
    """30 NaNs in a row, with 4 elements' worth of corrections per side (and per pass)."""
    gemm = small_gemm()
    out = gemm.c.clone()
    inject_(out, TensorFault("nan", "row", position=(7, 0), batch_index=0))
    faulty = out.clone()
    operands = gemm.operands if with_operands else None
    result = verify_and_correct(out, *gemm.checksums(), operands=operands, max_corrections=4)
    assert result.status.tolist() == [UNCORRECTABLE, CLEAN, CLEAN]
    assert identical(out, faulty)


def test_a_single_matrix_and_a_strided_view_are_corrected_in_place():
    gemm = small_gemm()
    big = torch.zeros(3, 50, 50)
    view = big[:, 5:35, 2:42].mT  # a strided [3, 40, 30] view holding C
    view.copy_(gemm.c)
    inject_(view, TensorFault("inf", "0d", position=(3, 4), batch_index=1))
    result = verify_and_correct(view, *gemm.checksums(), operands=gemm.operands)
    assert result.status.tolist() == [CLEAN, CORRECTED, CLEAN]
    assert_within_flash_rule(view, gemm)
    big[:, 5:35, 2:42] = 0
    assert not big.any()  # nothing written outside the view
    single = gemm.c[0].clone()
    single[1, 1] = math.nan
    col, row = encode(gemm.a[0], gemm.b[0], block=gemm.block)
    result = verify_and_correct(single, col, row)
    assert result.status.item() == CORRECTED and torch.isfinite(single).all()


def nasty_clean_batches(dtype: torch.dtype, count: int):
    """Clean GEMMs on data that stresses the thresholds; yields (a, b, block) batches."""
    g = torch.Generator().manual_seed(7)
    top = 3 if dtype == torch.float16 else 4  # keep fp16 outputs below its 65504 maximum
    magnitudes = 10.0 ** torch.empty(count, 24, 32).uniform_(-6, top, generator=g)
    yield (
        torch.randn(count, 24, 32, generator=g) * magnitudes,
        torch.randn(count, 32, 20, generator=g),
        16,
    )
    rows = torch.randn(count, 24, 1, generator=g).expand(count, 24, 32)  # all-equal rows
    yield rows, torch.full((count, 32, 20), 0.1), 8
    zeros = torch.randn(count, 24, 32, generator=g) * (torch.rand(count, 24, 1, generator=g) < 0.5)
    yield zeros, torch.zeros(count, 32, 20), 256
    yield torch.randn(count, 2, 4096, generator=g), torch.randn(count, 4096, 3, generator=g), 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_false_alarm_in_10000_clean_checks_on_nasty_data(dtype):
    checked = 0
    for a, b, block in nasty_clean_batches(dtype, count=2500):
        a, b = a.to(dtype), b.to(dtype)
        c = a @ b
        assert torch.isfinite(c).all()
        result = verify_and_correct(c, *encode(a, b, block=block))
        assert report(result)["detected"] == dict.fromkeys(KINDS, 0)
        checked += c.shape[0]
    assert checked >= 10_000


@pytest.mark.parametrize("with_operands", [True, False])
def test_verification_needs_no_host_synchronisation(with_operands):
    """On a device other than the CPU the whole correction path runs unconditionally; on meta
    tensors any read of a value on the host (item, bool, nonzero) would raise."""
    a = torch.empty(2, 4, 40, 16, device="meta")
    b = torch.empty(2, 4, 16, 30, device="meta")
    c = a @ b
    col, row = encode(a, b, block=16)
    result = verify_and_correct(
        c, col, row, operands=GemmOperands(a, b) if with_operands else None, check_references=False
    )
    assert result.counts.device.type == "meta" and result.status.shape == (2, 4)


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda g, col, row: verify_and_correct(g.c[:, :-1], col, row), ValueError, "do not fit c"),
        (lambda g, col, row: verify_and_correct(g.c.int(), col, row), TypeError, "c must be fp64"),
        (lambda g, col, row: verify_and_correct(g.c, row, None), ValueError, "col checksums"),
        (lambda g, col, row: verify_and_correct(g.c), ValueError, "at least one side"),
        (
            lambda g, col, row: verify_and_correct(g.c.to("meta"), col, row),
            ValueError,
            "is on meta",
        ),
        (
            lambda g, col, row: verify_and_correct(g.c, col, row, operands=GemmOperands(g.b, g.a)),
            ValueError,
            "do not produce c",
        ),
        (
            lambda g, col, row: verify_and_correct(
                g.c, replace(col, sums=col.sums.clone().fill_(math.inf)), row
            ),
            ValueError,
            "reference checksums contain NaN or INF",
        ),
    ],
)
def test_bad_input_raises_a_clear_error(make, error, message):
    gemm = small_gemm()
    with pytest.raises(error, match=message):
        make(gemm, *gemm.checksums())


def test_the_result_says_where_each_matrix_went_wrong_and_how_much():
    gemm = small_gemm()
    out = gemm.c.clone()
    out[1, 7, 9] = math.nan
    out[2, 3, 4] += 1e4
    result = verify_and_correct(out, *gemm.checksums(), operands=gemm.operands)
    assert result.row.tolist() == [-1, 7, 3] and result.col.tolist() == [-1, 9, 4]
    assert result.magnitude[0] == 0 and math.isnan(result.magnitude[1])
    assert result.magnitude[2] == pytest.approx(1e4, rel=1e-3)


@pytest.mark.parametrize("m, k, n", [(0, 4, 5), (3, 4, 0), (3, 0, 5)])
def test_empty_outputs_and_empty_inner_dimensions_check_cleanly(m, k, n):
    a, b = torch.randn(2, m, k), torch.randn(k, n)
    c = a @ b
    result = verify_and_correct(c, *encode(a, b, block=4), operands=GemmOperands(a, b))
    assert result.status.tolist() == [CLEAN, CLEAN]
    assert sum(report(result)["detected"].values()) == 0
