"""The compiled checksum kernels (csrc/, megatron_abft.ops.compiled) against an fp64 reference
and the PyTorch path of eec.py: on CPU always, on CUDA where a GPU is present."""

import os
from contextlib import nullcontext

import pytest
import torch
from cuda_targets import EMULATOR, ON_GPU, TARGETS, emulator_built
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from megatron_abft.check.checksum import encode, encode_columns, encode_rows
from megatron_abft.check.eec import GemmOperands, residuals, verify_and_correct
from megatron_abft.faults import TensorFault, inject_
from megatron_abft.ops import compiled

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
BLOCKS = [0, 2, 3, 16, 64, 255, 256, 300, 1024]
PROPERTY = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
needs_ext = pytest.mark.skipif(not compiled.available(), reason=compiled.backend())
needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and compiled.available()), reason="needs a GPU and the extension"
)
needs_emulator = pytest.mark.skipif(not emulator_built(), reason="no CUDA emulator in this build")
# the property tests through the CUDA emulator, about a second an example
EMULATED_PROPERTY = settings(PROPERTY, max_examples=20)


def block_sums(c, col_block, row_block):
    return torch.ops.megatron_abft.block_sums(c, col_block, row_block)


def reference(c: torch.Tensor, block: int, side: str) -> torch.Tensor:
    """fp64 plain and weighted sums of one side's vectors, [..., nb, 2, N], block by block."""
    x = (c if side == "col" else c.mT).double()
    parts = []
    for start in range(0, x.shape[-2], block):
        part = x[..., start : start + block, :]
        w = torch.arange(1, part.shape[-2] + 1, dtype=torch.float64).unsqueeze(-1)
        parts.append(torch.stack([part, w * part]).sum(-2).movedim(0, -2))
    return torch.stack(parts, -3)


def assert_sums_match(got, want, sizes, block: int, dtype: torch.dtype) -> None:
    """Equal up to the rounding of a sum of ``block`` terms in the accumulation dtype: same NaNs
    and INFs, finite values within (block + 2) eps sum |terms|."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert got.dtype == acc and got.shape == want.shape
    got = got.double().cpu()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.isinf(), want.isinf())
    assert torch.equal(got[got.isinf()], want[want.isinf()])
    finite = want.isfinite()
    bound = (block + 2) * torch.finfo(acc).eps * sizes + torch.finfo(acc).tiny
    assert ((got - want).abs()[finite] <= bound[finite]).all()


def check_block_sums(c: torch.Tensor, col_block: int, row_block: int) -> None:
    out = block_sums(c, col_block, row_block)
    for (sums, sizes), block, side in ((out[:2], col_block, "col"), (out[2:], row_block, "row")):
        if block == 0:
            assert sums.shape[-3] == 0 and sizes.shape[-3] == 0
            continue
        bound = reference(c.cpu().abs().nan_to_num(0, 0, 0), block, side)
        assert_sums_match(sums, reference(c.cpu(), block, side), bound, block, c.dtype)
        assert_sums_match(sizes, reference(c.cpu().abs(), block, side), bound, block, c.dtype)


@st.composite
def matrices(draw, device: str = "cpu"):
    """A strided batch of matrices with values over 12 decades and, sometimes, INF and NaN."""
    dtype = draw(st.sampled_from(DTYPES))
    batch = draw(st.sampled_from([(), (3,), (2, 3)]))
    m, n = draw(st.integers(1, 300)), draw(st.integers(1, 300))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    top = 3 if dtype == torch.float16 else 6
    scale = 10.0 ** torch.empty(*batch, m, 1).uniform_(-6, top, generator=g)
    values = torch.randn(*batch, m, n, generator=g) * scale
    for special in draw(st.lists(st.sampled_from([float("inf"), -float("inf"), float("nan")]))):
        values.view(-1)[int(torch.randint(values.numel(), (1,), generator=g))] = special
    values = values.to(device=device, dtype=dtype)
    layout = draw(st.sampled_from(["contiguous", "column-major", "sliced", "broadcast"]))
    if layout == "column-major":
        c = values.mT.contiguous().mT
    elif layout == "sliced":  # every other column of a larger buffer, offset by one row
        c = values.new_zeros(*batch, m + 1, 2 * n + 1)[..., 1:, 1::2]
        c.copy_(values)
    elif layout == "broadcast":  # one matrix seen through stride-0 batch dims
        c = values[(0,) * len(batch)].expand(*batch, m, n)
    else:
        c = values
    blocks = st.sampled_from(BLOCKS)
    col_block, row_block = draw(blocks), draw(blocks)
    if col_block == row_block == 0:
        col_block = 2
    return c, col_block, row_block


@st.composite
def products_cases(draw, device: str = "cpu"):
    """An operand from ``matrices`` and the vectors of row_products: u [..., r, k] (finite, any
    sign) and z [..., r', k] (non-negative, as magnitudes are), sometimes broadcast over a batch
    dim of a, and laid out contiguously, as rows of a wider tensor (one of a pair, as encoding
    takes the plain sums of magnitudes) or transposed; up to 40 of each (the CUDA kernels hold
    16 of each kind a pass over a row)."""
    a, _, _ = draw(matrices(device))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    acc = torch.float64 if a.dtype == torch.float64 else torch.float32
    batch, k = list(a.shape[:-2]), a.shape[-1]
    if batch and draw(st.booleans()):
        batch[draw(st.integers(0, len(batch) - 1))] = 1
    top = 40

    def vectors(make) -> torch.Tensor:
        rows = draw(st.integers(0, top))
        layout = draw(st.sampled_from(["contiguous", "one of a pair", "transposed"]))
        if layout == "one of a pair":
            return make(*batch, rows, 2, k)[..., 1, :]
        if layout == "transposed":
            return make(*batch, k, rows).mT
        return make(*batch, rows, k)

    u = vectors(lambda *shape: torch.randn(*shape, generator=g, dtype=acc))
    z = vectors(lambda *shape: torch.rand(*shape, generator=g, dtype=acc) * 300)
    return a, u.to(device), z.to(device)


# a column-major operand, as V^T is for the context GEMM, read column by column: 70 rows, a
# partial band of rows on CPU and a partial 32-row tile on CUDA; 40 vectors of one kind and 21 of
# the other, three and two passes of the CUDA kernels (16 of each kind a pass), the last partial
COLUMN_MAJOR_PRODUCTS = (
    torch.randn(2, 3, 300, 70).bfloat16().mT,
    torch.randn(2, 1, 40, 300),
    torch.rand(1, 3, 21, 300),
)
# the same read row by row (on CUDA four entries a load: rows contiguous and aligned; passes of
# 16 two rows a warp), and with an odd count of rows (a matrix's last row alone in its warp)
ROW_MAJOR_PRODUCTS = (torch.randn(2, 3, 70, 300).bfloat16(), *COLUMN_MAJOR_PRODUCTS[1:])
ODD_ROWS_PRODUCTS = (torch.randn(2, 3, 71, 300).bfloat16(), *COLUMN_MAJOR_PRODUCTS[1:])
# two vectors and one, as the attention's operands have: on CUDA a pass of two, two loads of A
# an iteration, the last iteration of a row with one load on 11 lanes (300 = 2 * 128 + 44)
FEW_PRODUCTS = (torch.randn(2, 70, 300).bfloat16(), torch.randn(2, 2, 300), torch.rand(2, 1, 300))
# rows that start off a load's boundary, and vectors whose rows do: read an entry at a time
UNALIGNED_PRODUCTS = (
    torch.randn(2, 70, 301).bfloat16()[..., 1:],
    torch.randn(2, 2, 302)[..., :300],
    torch.rand(2, 1, 300),
)


def check_row_products(a: torch.Tensor, u: torch.Tensor, z: torch.Tensor) -> None:
    """Equal to fp64 products up to the rounding of k terms: same NaNs and INFs, finite values
    within (k + 2) eps sum |terms|."""
    products, magnitudes = torch.ops.megatron_abft.row_products(a, u, z)
    x = a.cpu().double()
    for got, vectors, operand in ((products, u, x), (magnitudes, z, x.abs())):
        v = vectors.cpu().double()
        want = operand @ v.mT
        bound = x.abs().nan_to_num(0, 0, 0) @ v.abs().mT
        assert got.device == a.device and got.is_contiguous()
        assert_sums_match(got, want, bound, a.shape[-1], a.dtype)


def test_the_extension_is_built_and_says_which_path_runs():
    if os.environ.get("ABFT_BUILD") == "none":
        assert not compiled.available() and compiled.backend().startswith("torch (")
        return
    assert compiled.available(), compiled.backend()
    from megatron_abft import _C

    assert compiled.backend() == ("cuda" if _C.cuda and torch.cuda.is_available() else "cpu")
    assert _C.openmp == 1  # else at::parallel_for runs the CPU kernels on one thread
    with compiled.disabled():
        assert not compiled.available() and "disabled" in compiled.backend()
        assert compiled.block_sums(torch.ones(2, 2), 2, 2) is None
    assert compiled.available()


@needs_ext
@PROPERTY
@given(case=matrices())
@example(case=(torch.randn(4, 1024, 1024).bfloat16(), 256, 256))
@example(case=(torch.randn(3, 600, 700).half().mT, 256, 512))
def test_cpu_kernels_equal_the_fp64_sums(case):
    check_block_sums(*case)


@needs_ext
@PROPERTY
@given(case=products_cases())
@example(case=(torch.randn(8, 512, 512), torch.randn(8, 2, 512), torch.rand(1, 1, 512)))
@example(case=COLUMN_MAJOR_PRODUCTS)
@example(case=ROW_MAJOR_PRODUCTS)
def test_cpu_row_products_equal_the_fp64_products(case):
    check_row_products(*case)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_half_precision_value_is_read_exactly(dtype):
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    for c, col_block, row_block, index in ((every[:, None], 0, 2, 2), (every[None], 2, 0, 0)):
        got = block_sums(c, col_block, row_block)[index][0, 0]  # the plain sums: x itself
        assert torch.equal(got.isnan(), every.isnan())
        assert torch.equal(got.nan_to_num(), every.float().nan_to_num())


def gemm_case(dtype, batch, m, k, n, seed, bias=False):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(*batch, m, k, generator=g).to(dtype)
    b = torch.randn(k, n, generator=g).to(dtype)
    bias_t = torch.randn(n, generator=g).to(dtype) if bias else None
    c = (0.5 * (a @ b) + (0 if bias_t is None else bias_t)).to(dtype)
    return a, b, bias_t, c


@needs_ext
@PROPERTY
@given(
    dtype=st.sampled_from(DTYPES),
    batch=st.sampled_from([(), (2,), (2, 3)]),
    m=st.integers(1, 200),
    k=st.integers(1, 64),
    n=st.integers(1, 200),
    block=st.sampled_from([2, 16, 64, 256]),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_encoding_through_the_kernels_equals_the_pytorch_path(
    dtype, batch, m, k, n, block, bias, seed
):
    a, b, bias_t, _ = gemm_case(dtype, batch, m, k, n, seed, bias)
    fused = encode(a, b, alpha=0.5, bias=bias_t, block=block)
    with compiled.disabled():
        reference_sums = encode(a, b, alpha=0.5, bias=bias_t, block=block)
    for got, want in zip(fused, reference_sums, strict=True):
        assert got.sums.dtype == want.sums.dtype and got.sums.shape == want.sums.shape
        tol = (block + k + 4) * torch.finfo(want.sums.dtype).eps * want.magnitude
        weights = torch.tensor([1.0, block], dtype=tol.dtype).unsqueeze(-1)  # w_i <= block
        assert ((got.sums - want.sums).abs() <= weights * tol.unsqueeze(-2)).all()
        assert ((got.magnitude - want.magnitude).abs() <= tol).all()
        assert (got.bias_magnitude is None) == (want.bias_magnitude is None)


@needs_ext
@PROPERTY
@given(
    dtype=st.sampled_from(DTYPES),
    batch=st.sampled_from([(2,), (2, 3)]),
    m=st.integers(2, 300),
    n=st.integers(2, 300),
    block=st.sampled_from([2, 16, 64, 256]),
    kind=st.sampled_from(["inf", "-inf", "nan", "near_inf", "value", "none"]),
    pattern=st.sampled_from(["0d", "row", "col", "2d"]),
    seed=st.integers(0, 2**16),
)
def test_without_operands_the_kernels_path_equals_the_pytorch_path(
    dtype, batch, m, n, block, kind, pattern, seed
):
    """The screen, then the PyTorch path on the kernels' block sums, rebuilding from the
    checksums (with the operands: tests/ops/test_ext_correct.py)."""
    a, b, bias, c = gemm_case(dtype, batch, m, 16, n, seed)
    if kind != "none":
        inject_(c, TensorFault(kind, pattern, value=1e4, seed=seed))
    col, row = encode(a, b, alpha=0.5, block=block)
    fused_c, torch_c = c.clone(), c.clone()
    fused = verify_and_correct(fused_c, col, row, check_references=False)
    with compiled.disabled():
        reference_result = verify_and_correct(torch_c, col, row, check_references=False)
    assert torch.equal(fused_c.isnan(), torch_c.isnan())
    assert torch.equal(fused_c.nan_to_num(), torch_c.nan_to_num())  # bit for bit
    assert_same_result(fused, reference_result, pattern)
    for side, ref in (("col", col), ("row", row)):
        got = residuals(fused_c, ref, side=side)
        with compiled.disabled():
            want = residuals(fused_c, ref, side=side)
        assert torch.equal(got.flagged, want.flagged)
        torch.testing.assert_close(got.tau, want.tau, equal_nan=True)


def assert_same_result(fused, want, pattern: str) -> None:
    """Two EECResults of one check (the kernels' path and the PyTorch path): equal counts,
    statuses and kinds, magnitudes close, and the same worst row and column for a 0D fault
    (for others, equally wrong vectors may swap places by rounding)."""
    for name in ("counts", "status", "kind"):
        assert torch.equal(getattr(fused, name), getattr(want, name)), name
    for name in ("row", "col"):
        got, expected = getattr(fused, name), getattr(want, name)
        assert torch.equal(got, expected) if pattern == "0d" else torch.equal(got < 0, expected < 0)
    torch.testing.assert_close(fused.magnitude, want.magnitude, equal_nan=True)


@needs_ext
def test_one_call_reads_c_for_both_sides(monkeypatch):
    calls = []
    kernel = compiled.block_sums

    def spy(c, col_block, row_block):
        calls.append((col_block, row_block))
        return kernel(c, col_block, row_block)

    monkeypatch.setattr(compiled, "block_sums", spy)
    a, b, _, c = gemm_case(torch.bfloat16, (2,), 90, 8, 70, seed=0)
    col, row = encode(a, b, alpha=0.5, block=32)
    calls.clear()
    inject_(c, TensorFault("inf", "0d", seed=1))
    result = verify_and_correct(c, col, row)
    assert result.status.tolist().count(1) == 1
    assert calls == [(32, 32), (32, 32)]  # the check, and the re-check after correcting


@needs_ext
@pytest.mark.parametrize(
    "c, col_block, row_block",
    [
        (torch.randn(3, 37, 53), 16, 7),
        (torch.randn(2, 3, 40, 30, dtype=torch.float64).mT, 0, 8),
        (torch.randn(1, 200, 300).bfloat16()[..., ::3], 64, 0),
        (torch.randn(5, 1).half(), 2, 2),
    ],
)
def test_opcheck_schema_fake_and_autograd_registration(c, col_block, row_block):
    torch.library.opcheck(torch.ops.megatron_abft.block_sums.default, (c, col_block, row_block))
    u = torch.randn(*c.shape[:-2], 3, c.shape[-1], dtype=torch.float32).to(
        torch.float64 if c.dtype == torch.float64 else torch.float32
    )
    torch.library.opcheck(torch.ops.megatron_abft.row_products.default, (c, u, u[..., :1, :]))
    if not (c.stride(-2) == 1 and c.stride(-1) != 1):
        block = max(col_block, 2)
        torch.library.opcheck(
            torch.ops.megatron_abft.operand_pass.default, (c, block, u, u[..., :1, :].abs())
        )


@needs_ext
def test_tensors_the_kernels_do_not_serve_take_the_pytorch_path():
    assert compiled.block_sums(torch.empty(4, 4, device="meta"), 2, 2) is None
    assert compiled.block_sums(torch.ones(4, 4, dtype=torch.int32), 2, 2) is None
    assert compiled.block_sums(torch.ones(*(1,) * 9, 4, 4), 2, 2) is None


@needs_ext
@pytest.mark.parametrize(
    "c, col_block, row_block, message",
    [
        (torch.ones(4, 4, dtype=torch.int32), 2, 2, "c must be fp32, fp64, bf16 or fp16; got Int"),
        (torch.ones(4), 2, 2, r"c must be \[\*batch, m, n\]"),
        (torch.ones(*(1,) * 9, 4, 4), 2, 2, "at most 8 batch dims"),
        (torch.ones(4, 4), 1, 2, "col_block must be 0 .* or >= 2; got 1"),
        (torch.ones(4, 4), 2, -3, "row_block must be 0 .* or >= 2; got -3"),
        (torch.ones(4, 4), 0, 0, "give col_block or row_block"),
    ],
)
def test_bad_inputs_raise_clear_errors(c, col_block, row_block, message):
    with pytest.raises((RuntimeError, NotImplementedError), match=message):
        block_sums(c, col_block, row_block)


@needs_ext
@pytest.mark.parametrize(
    "a, u, z, message",
    [
        (torch.ones(4, 4, dtype=torch.int32), torch.ones(1, 4), torch.ones(1, 4), "got Int"),
        (torch.ones(4, 4), torch.ones(1, 4).double(), torch.ones(1, 4), "u must be Float"),
        (
            torch.ones(4, 4).double(),
            torch.ones(1, 4).double(),
            torch.ones(1, 4),
            "z must be Double",
        ),
        (torch.ones(4, 4), torch.ones(1, 3), torch.ones(1, 4), r"u must be \[\*batch, r, 4\]"),
        (torch.ones(2, 4, 4), torch.ones(1, 4), torch.ones(1, 4), "as many dims as a"),
        (torch.ones(2, 4, 4), torch.ones(3, 1, 4), torch.ones(2, 1, 4), "does not broadcast"),
        (torch.ones(4), torch.ones(1, 4), torch.ones(1, 4), r"a must be \[\*batch, m, k\]"),
    ],
)
def test_row_products_bad_inputs_raise_clear_errors(a, u, z, message):
    with pytest.raises((RuntimeError, NotImplementedError), match=message):
        torch.ops.megatron_abft.row_products(a, u, z)


@needs_ext
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_product_kernels_scale_their_outputs_as_a_multiplication_would(device, dtype):
    """row_products and operand_pass apply a GEMM's alpha as they write (one launch fewer each
    on a GPU than multiplying after): bit for bit the unscaled outputs times alpha, and the
    magnitudes times |alpha|."""
    g = torch.Generator().manual_seed(3)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    a = torch.randn(2, 3, 70, 40, generator=g).to(device=device, dtype=dtype)
    u = torch.randn(2, 1, 6, 40, generator=g, dtype=acc).to(device)
    z = torch.rand(2, 3, 2, 5, 40, generator=g, dtype=acc).to(device)[:, :, 0]
    for alpha in (0.125, -3.0):
        scaled = torch.ops.megatron_abft.row_products(a, u, z, alpha)
        plain = torch.ops.megatron_abft.row_products(a, u, z)
        assert torch.equal(scaled[0], plain[0] * alpha)
        assert torch.equal(scaled[1], plain[1] * abs(alpha))
        passed = torch.ops.megatron_abft.operand_pass(a, 16, u, z, alpha)
        assert torch.equal(passed[2], scaled[0]) and torch.equal(passed[3], scaled[1])


@needs_ext
def test_encoding_reads_the_larger_operand_once():
    p = torch.rand(2, 4, 3, 128, 96)  # probabilities [b, groups, heads per group, sq, sk]
    v = torch.randn(2, 4, 1, 96, 16)  # values shared by each group's heads
    cpu = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=cpu, record_shapes=True, acc_events=True) as profile:
        fused = encode(p, v, block=32)
    views = ("aten::detach", "detach", "megatron_abft::encode_pair")  # no data read
    readers = [
        e.name
        for e in profile.events()
        if e.input_shapes and e.input_shapes[0] == list(p.shape) and e.name not in views
    ]
    assert readers == ["megatron_abft::operand_pass"]  # P read once, in place, for both sides
    for got, want in zip(
        fused, (encode_columns(p, v, block=32), encode_rows(p, v, block=32)), strict=True
    ):
        torch.testing.assert_close(got.sums, want.sums)
        torch.testing.assert_close(got.magnitude, want.magnitude)


@needs_ext
@pytest.mark.parametrize(
    "a, block, u, z, message",
    [
        (
            torch.ones(4, 4).mT.contiguous().mT[:, :3],
            2,
            torch.ones(1, 3),
            torch.ones(1, 3),
            "column",
        ),
        (torch.ones(4, 4), 0, torch.ones(1, 4), torch.ones(1, 4), "block must be >= 2"),
        (torch.ones(4, 4), 2, torch.ones(1, 3), torch.ones(1, 4), r"u must be \[\*batch, r, 4\]"),
    ],
)
def test_operand_pass_bad_inputs_raise_clear_errors(a, block, u, z, message):
    with pytest.raises((RuntimeError, NotImplementedError), match=message):
        torch.ops.megatron_abft.operand_pass(a, block, u, z)


@needs_ext
@PROPERTY
@given(case=products_cases(), block=st.sampled_from([2, 16, 64, 256]))
def test_operand_pass_equals_block_sums_and_row_products(case, block):
    a, u, z = case
    if a.stride(-2) == 1 and a.stride(-1) != 1 and a.shape[-2] > 1:
        a = a.contiguous()  # operand_pass reads rows
    sums, sizes, products, magnitudes = torch.ops.megatron_abft.operand_pass(a, block, u, z)
    want = block_sums(a, block, 0)
    for got, expected in ((sums, want[0]), (sizes, want[1])):
        torch.testing.assert_close(got, expected, equal_nan=True)
    for got, expected in zip(
        (products, magnitudes), torch.ops.megatron_abft.row_products(a, u, z), strict=True
    ):
        torch.testing.assert_close(got, expected, equal_nan=True)


@needs_cuda
@PROPERTY
@given(case=matrices(device="cuda"))
@example(case=(torch.randn(4, 1024, 1024).bfloat16(), 256, 256))
@example(case=(torch.randn(3, 600, 2100).half(), 100, 1000))
def test_cuda_kernels_equal_the_fp64_sums(case):
    c, col_block, row_block = case
    check_block_sums(c.cuda(), col_block, row_block)  # the examples are made on the CPU


@needs_cuda
@PROPERTY
@given(case=products_cases(device="cuda"))
@example(case=COLUMN_MAJOR_PRODUCTS)
@example(case=ROW_MAJOR_PRODUCTS)
@example(case=ODD_ROWS_PRODUCTS)
@example(case=FEW_PRODUCTS)
@example(case=UNALIGNED_PRODUCTS)
def test_cuda_row_products_equal_the_fp64_products(case):
    check_row_products(*(t.cuda() for t in case))  # the example is made on the CPU


@needs_emulator
@EMULATED_PROPERTY
@given(case=matrices())
@example(case=(torch.randn(4, 1024, 1024).bfloat16(), 256, 256))
@example(case=(torch.randn(3, 600, 2100).half(), 100, 1000))
def test_emulated_cuda_kernels_equal_the_fp64_sums(case):
    with compiled.emulated_cuda():
        check_block_sums(*case)


@needs_emulator
@EMULATED_PROPERTY
@given(case=products_cases())
@example(case=COLUMN_MAJOR_PRODUCTS)
@example(case=ROW_MAJOR_PRODUCTS)
@example(case=ODD_ROWS_PRODUCTS)
@example(case=FEW_PRODUCTS)
@example(case=UNALIGNED_PRODUCTS)
def test_emulated_cuda_row_products_equal_the_fp64_products(case):
    with compiled.emulated_cuda():
        check_row_products(*case)


@pytest.mark.parametrize("gpu", TARGETS)
def test_cuda_verify_and_correct_equals_the_cpu_result(gpu):
    a, b, _, c = gemm_case(torch.bfloat16, (2, 4), 512, 64, 384, seed=3)
    inject_(c, TensorFault("nan", "row", batch_index=5, seed=3))
    inject_(c, TensorFault("near_inf", "0d", batch_index=2, seed=4))

    def run(device):
        a_d, b_d, out = a.to(device), b.to(device), c.clone().to(device)
        col, row = encode(a_d, b_d, alpha=0.5, block=128)
        return verify_and_correct(out, col, row, operands=GemmOperands(a_d, b_d, 0.5)), out

    cpu, cpu_c = run("cpu")
    with gpu.kernels():
        got, got_c = run(gpu.device)
    assert torch.equal(got.status.cpu(), cpu.status) and torch.equal(got.counts.cpu(), cpu.counts)
    assert got.status.flatten().tolist().count(1) == 2 and torch.isfinite(got_c).all()
    torch.testing.assert_close(got_c.cpu(), cpu_c)


@needs_cuda
def test_cuda_opcheck_and_current_stream():
    c = torch.randn(2, 300, 200, device="cuda")
    torch.library.opcheck(torch.ops.megatron_abft.block_sums.default, (c, 64, 128))
    u = torch.randn(2, 5, 200, device="cuda")
    torch.library.opcheck(torch.ops.megatron_abft.row_products.default, (c, u, u.abs()))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        got = block_sums(c, 64, 128)
    stream.synchronize()
    for g, w in zip(got, block_sums(c, 64, 128), strict=True):
        torch.testing.assert_close(g, w)


@needs_cuda
def test_cuda_checks_are_a_few_ops_whether_or_not_they_may_sync():
    a, b, _, c = gemm_case(torch.bfloat16, (2, 4), 256, 64, 192, seed=5)
    a, b, c = a.cuda(), b.cuda(), c.cuda()
    col, row = encode(a, b, alpha=0.5, block=64)
    operands = GemmOperands(a, b, 0.5)
    ops = {}
    for sync_free in (True, False):
        cpu = [torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=cpu, acc_events=True) as profile:
            verify_and_correct(c, col, row, operands=operands, sync_free=sync_free)
        ops[sync_free] = sum(1 for e in profile.events() if e.cpu_parent is None)
    assert max(ops.values()) <= 30  # verify_correct and the counters, no PyTorch path
    for sync_free in (True, False):
        faulty = c.clone()
        inject_(faulty, TensorFault("nan", "row", batch_index=3, seed=2))
        result = verify_and_correct(faulty, col, row, operands=operands, sync_free=sync_free)
        assert result.status.flatten().tolist().count(1) == 1 and torch.isfinite(faulty).all()


def screen_case(dtype, batch, m, n, block, bias, sides, seed):
    """A GEMM output [*batch, m, n] with its references on the chosen sides (a dict for
    megatron_abft.check.sides) and the Check of a default verify_and_correct call."""
    from megatron_abft.check.sides import Check
    from megatron_abft.check.tolerance import gemm_rounding

    a, b, bias_t, c = gemm_case(dtype, batch, m, 16, n, seed, bias)
    col, row = encode(a, b, alpha=0.5, bias=bias_t, block=block)
    refs = {name: ref for name, ref in (("col", col), ("row", row)) if name in sides}
    return c, refs, Check(gemm_rounding(c.dtype, c.device), 1.0, 1e10, max(m, n), None)


def corrupted(c: torch.Tensor, kind: str, pattern: str, layout: str, seed: int) -> torch.Tensor:
    """``c`` with a fault of ``kind`` ("none": none) landed in place, stored row by row or, with
    layout "column-major", column by column."""
    if kind != "none":
        inject_(c, TensorFault(kind, pattern, value=1e4, seed=seed))
    return c.mT.contiguous().mT if layout == "column-major" else c


def reference_flags(c, refs, check) -> torch.Tensor:
    """Per matrix, the vectors the PyTorch comparison of megatron_abft.check.sides flags."""
    from megatron_abft.check.sides import inspect_sides

    with compiled.disabled():
        sides = inspect_sides(c, refs, check)
    return sum(s.flagged.flatten(-2).sum(-1).expand(c.shape[:-2]) for s in sides.values())


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
    kind=st.sampled_from(["inf", "nan", "near_inf", "value", "bitflip", "none"]),
    pattern=st.sampled_from(["0d", "row", "col", "2d"]),
    seed=st.integers(0, 2**16),
)
def test_screen_flags_what_the_reference_comparison_flags(
    dtype, batch, m, n, block, bias, sides, layout, kind, pattern, seed
):
    from megatron_abft.check.sides import screen

    c, refs, check = screen_case(dtype, batch, m, n, block, bias, sides, seed)
    c = corrupted(c, kind, pattern, layout, seed)
    flagged = screen(c, refs, check)
    assert flagged.dtype == torch.int32 and flagged.shape == c.shape[:-2]
    assert torch.equal(flagged.long(), reference_flags(c, refs, check))


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_screen_flags_a_difference_just_inside_the_threshold_and_the_check_stays_clean(dtype):
    """A column whose difference sits between the screen's tightened threshold and the
    reference's: the screen sends it on, the full comparison finds it clean."""
    from megatron_abft.check.sides import screen

    c = torch.zeros(1, 8, 3, dtype=dtype)
    c[0, 0, 1], c[0, 1, 1] = 1.0, -1.0  # column 1 sums to exactly 0, its weighted sum to -1
    col = encode(torch.eye(8, dtype=dtype).unsqueeze(0), c, block=8)[0]
    tau = residuals(c, col).tau[0, 0, 1]
    col.sums[0, 0, 0, 1] = tau * (1 - 2.0**-18)  # d1 just below tau, d2 = 0
    _, refs, check = screen_case(dtype, (1,), 8, 3, 8, False, (), 0)
    assert int(screen(c, {"col": col}, check)[0]) == 1
    assert not bool(residuals(c, col).flagged.any())
    before = c.clone()
    result = verify_and_correct(c, col)
    assert result.known_clean and int(result.status[0]) == 0 and torch.equal(c, before)


@needs_ext
def test_a_check_is_one_op_of_the_kernels(monkeypatch):
    """With the GEMM's operands, clean or faulty: verify_correct. Without them, a clean check
    is the screen and a faulty one goes on to the PyTorch path."""
    calls = []
    for name in ("block_sums", "screen", "verify_correct"):
        kernel = getattr(compiled, name)

        def spy(c, *args, name=name, kernel=kernel):
            calls.append(name)
            return kernel(c, *args)

        monkeypatch.setattr(compiled, name, spy)
    a, b, _, c = gemm_case(torch.bfloat16, (2, 3), 64, 16, 48, seed=1)
    col, row = encode(a, b, alpha=0.5, block=32)
    operands = GemmOperands(a, b, 0.5)
    faulty = c.clone()
    inject_(faulty, TensorFault("inf", "0d", seed=1))
    for supplied in (operands, None):
        calls.clear()
        clean = verify_and_correct(c, col, row, operands=supplied)
        first = "verify_correct" if supplied else "screen"
        assert clean.known_clean and calls == [first]
        calls.clear()
        result = verify_and_correct(faulty.clone(), col, row, operands=supplied)
        assert not result.known_clean and int((result.status == 1).sum()) == 1
        # without the operands, the PyTorch path's check and re-check follow the screen
        assert calls == ([first] if supplied else [first, "block_sums", "block_sums"])


def screen_args(c, refs, check):
    """The arguments of megatron_abft::screen for references ``refs`` of c."""
    from megatron_abft.check.tolerance import threshold_terms

    args = [c]
    sides = {"col": (0, [], []), "row": (0, [], [])}
    for name, ref in refs.items():
        length = min(ref.block, ref.length)
        terms = threshold_terms(check.rounding, length=length, inner=ref.inner, scale=1.0)
        tensors = [ref.sums, ref.magnitude] + (
            [] if ref.bias_magnitude is None else [ref.bias_magnitude]
        )
        sides[name] = (ref.block, tensors, [*terms, float(length)])
    args += [sides["col"][0], sides["row"][0], sides["col"][1], sides["row"][1]]
    return (*args, sides["col"][2], sides["row"][2])


@needs_ext
@pytest.mark.parametrize("bias", [False, True])
def test_screen_opcheck(bias):
    c, refs, check = screen_case(torch.bfloat16, (2,), 40, 30, 16, bias, ("col", "row"), 2)
    torch.library.opcheck(torch.ops.megatron_abft.screen.default, screen_args(c, refs, check))


@needs_ext
@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: (*a[:3], a[3][:1], *a[4:]), r"col must be \[sums, magnitude\]"),
        (lambda a: (*a[:3], [a[3][0].double(), a[3][1]], *a[4:]), "col sums must be Float"),
        (lambda a: (*a[:3], [a[3][0][..., :5], a[3][1]], *a[4:]), "does not broadcast"),
        (lambda a: (a[0], 0, *a[2:]), "col_block is 0 but col references were given"),
        (lambda a: (*a[:5], a[5][:3], a[6]), r"col_bounds must be \(out, gemm, floor, length\)"),
        (lambda a: (a[0], 0, 0, [], [], [], []), "give col_block or row_block"),
    ],
)
def test_screen_bad_inputs_raise_clear_errors(change, message):
    c, refs, check = screen_case(torch.float32, (2,), 40, 30, 16, False, ("col", "row"), 2)
    with pytest.raises((RuntimeError, NotImplementedError), match=message):
        torch.ops.megatron_abft.screen(*change(screen_args(c, refs, check)))


SCREEN_CASES = {
    "dtype": st.sampled_from(DTYPES),
    "block": st.sampled_from([2, 64, 256, 512]),
    "bias": st.booleans(),
    "layout": st.sampled_from(["contiguous", "column-major"]),
    "kind": st.sampled_from(["inf", "nan", "value", "bitflip", "none"]),
    "pattern": st.sampled_from(["0d", "row", "col"]),
    "seed": st.integers(0, 2**16),
}


def check_cuda_screen(gpu, dtype, block, bias, layout, kind, pattern, seed, m=300, n=290):
    """The CUDA block sums screen the vectors each tile completes (block 512: a tile two passes
    wide; column-major: C read as C^T, its sides swapped), as the C++ kernels' screen."""
    from megatron_abft.check.sides import screen

    c, refs, check = screen_case(dtype, (2, 3), m, n, block, bias, ("col", "row"), seed)
    c = corrupted(c, kind, pattern, layout, seed)
    on_gpu = {name: moved(ref, gpu.device) for name, ref in refs.items()}
    want = screen(c, refs, check)
    with gpu.kernels():
        assert torch.equal(screen(c.to(gpu.device), on_gpu, check).cpu(), want)
        if not gpu.emulated:  # the op's schema and fake; slow to emulate at every example
            args = screen_args(c.to(gpu.device), on_gpu, check)
            torch.library.opcheck(torch.ops.megatron_abft.screen.default, args)


@needs_cuda
@PROPERTY
@given(**SCREEN_CASES)
def test_cuda_screen_equals_the_cpu_screen(dtype, block, bias, layout, kind, pattern, seed):
    check_cuda_screen(ON_GPU, dtype, block, bias, layout, kind, pattern, seed)


@needs_emulator
@EMULATED_PROPERTY
@given(**SCREEN_CASES)
def test_emulated_cuda_screen_equals_the_cpu_screen(
    dtype, block, bias, layout, kind, pattern, seed
):
    """As on a GPU, on 70 rows (a tile two passes wide needs the columns only), and blocks of 2
    on 60 columns (a shuffle per row and pair of columns is slow to emulate)."""
    m, n = 70, 60 if block == 2 else 290
    check_cuda_screen(EMULATOR, dtype, block, bias, layout, kind, pattern, seed, m, n)


def moved(ref, device):
    """Reference checksums on ``device``."""
    from dataclasses import replace

    bias = ref.bias_magnitude
    return replace(
        ref,
        sums=ref.sums.to(device),
        magnitude=ref.magnitude.to(device),
        bias_magnitude=None if bias is None else bias.to(device),
    )


# the attention GEMMs' operands as ProtectedDotProductAttention hands them over ([b, groups,
# heads per group, rows, cols], K and V shared by a group's heads, K^T column-major), a linear
# layer's (tokens x hidden, W^T column-major), and a GEMM whose second operand is the larger
ENCODE_CASES = {
    "scores": lambda g: (
        torch.randn(2, 3, 4, 200, 32, generator=g),
        torch.randn(2, 3, 1, 300, 32, generator=g).mT,
    ),
    "context": lambda g: (
        torch.rand(2, 3, 4, 200, 300, generator=g),
        torch.randn(2, 3, 1, 300, 32, generator=g),
    ),
    "linear": lambda g: (torch.randn(90, 64, generator=g), torch.randn(120, 64, generator=g).t()),
    "wide b": lambda g: (
        torch.randn(3, 40, 16, generator=g),
        torch.randn(3, 500, 16, generator=g).mT,
    ),
}


@needs_ext
@pytest.mark.parametrize("case", sorted(ENCODE_CASES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("alpha", [1.0, -0.125])
def test_encode_pair_equals_the_pytorch_path(case, dtype, alpha):
    a, b = (t.to(dtype) for t in ENCODE_CASES[case](torch.Generator().manual_seed(0)))
    fused = compiled.encode_pair(a, b, alpha, 64)
    assert fused is not None
    with compiled.disabled():
        col, row = encode(a, b, alpha=alpha, block=64)
    for got, want in zip(fused, (col.sums, col.magnitude, row.sums, row.magnitude), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@needs_ext
@pytest.mark.parametrize("case", sorted(ENCODE_CASES))
def test_encode_pair_reads_every_operand_with_the_kernels(case):
    """No BLAS, cast or abs in the encoding of the attention's and linear layers' GEMMs: a
    column-major smaller operand (V^T for the context) goes to the products kernel, which reads
    it column by column."""
    a, b = (t.bfloat16() for t in ENCODE_CASES[case](torch.Generator().manual_seed(0)))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        compiled.encode_pair(a, b, 0.5, 64)
    ops = {e.name for e in profile.events()}
    assert "megatron_abft::row_products" in ops, ops
    assert not ops & {"aten::bmm", "aten::mm", "aten::matmul", "aten::abs", "aten::_to_copy"}


@needs_ext
def test_encode_pair_declines_what_the_kernels_do_not_take():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    assert compiled.encode_pair(a, b.double(), 1.0, 4) is None  # mixed dtypes
    assert compiled.encode_pair(a.mT.contiguous().mT, b, 1.0, 4) is None  # the larger, column-major
    assert compiled.encode_pair(torch.empty(8, 0), torch.empty(0, 4), 1.0, 4) is None
    with compiled.disabled():
        assert compiled.encode_pair(a, b, 1.0, 4) is None
    col, row = encode(a.mT.contiguous().mT, b, block=4)  # one side at a time, still right
    with compiled.disabled():
        want = encode(a, b, block=4)
    torch.testing.assert_close(col.sums, want[0].sums)
    torch.testing.assert_close(row.sums, want[1].sums)


@needs_ext
def test_encode_pair_opcheck():
    a, b = ENCODE_CASES["scores"](torch.Generator().manual_seed(1))
    torch.library.opcheck(torch.ops.megatron_abft.encode_pair.default, (a, b, 0.5, 64))


@needs_ext
@pytest.mark.parametrize("case", sorted(ENCODE_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_encode_pair_split_is_encode_pair_in_two_ops(case, dtype):
    """encode_pair as a GPU runs it (both operands' block sums in one op, both products in
    another: one launch each there) gives what the CPU's composition gives."""
    a, b = (t.to(dtype) for t in ENCODE_CASES[case](torch.Generator().manual_seed(3)))
    want = compiled.encode_pair(a, b, -0.5, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        split = torch.ops.megatron_abft.encode_pair_split(a, b, -0.5, 64)
    for got, w in zip(split, want, strict=True):
        assert got.dtype == w.dtype and got.shape == w.shape
        torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-5 * float(w.abs().max()))
    ops = [e.name for e in profile.events() if e.name.startswith("megatron_abft::")]
    kernels = {"megatron_abft::block_sums_pair", "megatron_abft::row_products_pair"}
    assert kernels <= set(ops) and "megatron_abft::operand_pass" not in ops
    torch.library.opcheck(torch.ops.megatron_abft.encode_pair_split.default, (a, b, -0.5, 64))


def pair_case(device="cpu"):
    """Two operands of one dtype, row-major and column-major, and vectors for their products."""
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(2, 50, 24, generator=g), torch.randn(2, 24, 70, generator=g).mT
    u, z, v, y = (torch.randn(2, r, 24, generator=g) for r in (3, 2, 1, 4))
    return tuple(t.to(device) for t in (a, b, u, z, v, y))


def check_pair_ops(device, kernels=None):
    """block_sums_pair and row_products_pair on ``device``, the kernels called inside
    ``kernels`` (a context), against the two ops of the C++ kernels."""
    a, b, u, z, v, y = pair_case(device)
    cpu = [t.cpu() for t in (a, b, u, z, v, y)]
    block_singles = (*compiled.block_sums(cpu[0], 16, 8), *compiled.block_sums(cpu[1], 0, 32))
    product_singles = (
        *compiled.row_products(cpu[0], *cpu[2:4]),
        *compiled.row_products(cpu[1], *cpu[4:]),
    )
    with kernels or nullcontext():
        pair = torch.ops.megatron_abft.block_sums_pair(a, 16, 8, b, 0, 32)
        for got, want in zip(pair, block_singles, strict=True):
            torch.testing.assert_close(got.cpu(), want)
        pair = torch.ops.megatron_abft.row_products_pair(a, u, z, 0.5, b, v, y, -2.0)
        for got, want, scale in zip(pair, product_singles, (0.5, 0.5, -2.0, 2.0), strict=True):
            torch.testing.assert_close(got.cpu(), want * scale)
        for op, args in (
            (torch.ops.megatron_abft.block_sums_pair, (a, 16, 8, b, 0, 32)),
            (torch.ops.megatron_abft.row_products_pair, (a, u, z, 0.5, b, v, y, -2.0)),
        ):
            torch.library.opcheck(op.default, args)


@needs_ext
def test_the_pair_ops_are_the_two_ops():
    check_pair_ops("cpu")


@pytest.mark.parametrize("gpu", TARGETS)
def test_the_cuda_pair_ops_equal_the_two_ops(gpu):
    check_pair_ops(gpu.device, gpu.kernels())


@needs_cuda
def test_cuda_pair_ops_are_one_launch_each():
    a, b, u, z, v, y = pair_case("cuda")
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        torch.ops.megatron_abft.block_sums_pair(a, 16, 8, b, 0, 32)
        torch.ops.megatron_abft.row_products_pair(a, u, z, 0.5, b, v, y, -2.0)
        torch.cuda.synchronize()
    kernels = [e.name for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 2, kernels


def _biased(a, b, bias, block):
    """add_bias on the sums without the bias, and the PyTorch path's checksums with it."""
    with compiled.disabled():
        col, row = encode(a, b, block=block)
        sums = (col.sums, col.magnitude, row.sums, row.magnitude)
        col, row = encode(a, b, bias=bias, block=block)
    got = compiled.add_bias(sums, bias, a.shape[-2], block)
    want = (col.sums, col.magnitude, row.sums, row.magnitude)
    return got, want + (col.bias_magnitude, row.bias_magnitude)


@needs_ext
@PROPERTY
@given(
    dtype=st.sampled_from(DTYPES),
    batch=st.sampled_from([(), (3,), (2, 2)]),
    m=st.integers(1, 150),
    n=st.integers(1, 150),
    block=st.sampled_from([2, 7, 32, 256]),
    strided=st.booleans(),
    seed=st.integers(0, 2**16),
)
@example(torch.bfloat16, (), 100, 90, 32, True, 0)  # partial blocks on both sides
def test_add_bias_equals_the_pytorch_path(dtype, batch, m, n, block, strided, seed):
    """The bias's terms in one op: the column side bit for bit (one rounding per term, as the
    PyTorch path), the row side's sums over each block of columns to fp32 rounding."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(*batch, m, 8, generator=g).to(dtype)
    b = torch.randn(8, n, generator=g).to(dtype)
    bias = (torch.randn(2 * n, generator=g) * 10).to(dtype)
    bias = bias[::2] if strided else bias[:n]
    got, want = _biased(a, b, bias, block)
    for i, (x, y) in enumerate(zip(got, want, strict=True)):
        assert x.dtype == y.dtype and x.shape == y.shape, (i, x.shape, y.shape)
        if i in (0, 1, 4):  # the column side
            torch.testing.assert_close(x, y, rtol=0, atol=0)
        else:
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5 * float(y.abs().max()))


@needs_ext
def test_add_bias_opcheck_and_bad_inputs():
    a, b = torch.randn(2, 40, 8), torch.randn(8, 30)
    sums = compiled.encode_pair(a, b, 1.0, 16)
    bias = torch.randn(30)
    torch.library.opcheck(torch.ops.megatron_abft.add_bias.default, (*sums, bias, 40, 16))
    op = torch.ops.megatron_abft.add_bias
    with pytest.raises(RuntimeError, match="are not those of 40 rows and 29 columns"):
        op(*sums, bias[:29], 40, 16)
    with pytest.raises(RuntimeError, match="are not those of 50 rows"):
        op(*sums, bias, 50, 16)
    with pytest.raises(RuntimeError, match="bias must be a vector"):
        op(*sums, bias.view(5, 6), 40, 16)
    with pytest.raises(RuntimeError, match="need one dtype"):
        op(sums[0], sums[1].double(), *sums[2:], bias, 40, 16)
    with pytest.raises(RuntimeError, match="block and m must be >= 1"):
        op(*sums, bias, 40, 0)
    with pytest.raises(RuntimeError, match="do not share their batch dims"):
        op(sums[0][:1], *sums[1:], bias, 40, 16)
    strided = [t.mT.contiguous().mT for t in sums]  # read where they are, as the contiguous ones
    for got, want in zip(op(*strided, bias, 40, 16), op(*sums, bias, 40, 16), strict=True):
        assert torch.equal(got, want)


@needs_ext
def test_a_bias_is_one_op_of_a_check():
    """With the kernels, a GEMM with a bias encodes in two ops (encode_pair, add_bias) and a few
    views, and its checksums are those of the PyTorch path."""
    a, b, bias = torch.randn(64, 32), torch.randn(32, 48), torch.randn(48)
    cpu = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=cpu, acc_events=True) as profile:
        col, row = encode(a, b, bias=bias, block=16)
    ops = [e.name for e in profile.events() if e.cpu_parent is None and "::" in e.name]
    assert [op for op in ops if op.startswith("megatron_abft::")] == [
        "megatron_abft::encode_pair",
        "megatron_abft::add_bias",
    ]
    assert set(ops) - {"megatron_abft::encode_pair", "megatron_abft::add_bias"} <= {
        "aten::detach",
        "aten::mT",
    }, ops  # views: no data read
    with compiled.disabled():
        want = encode(a, b, bias=bias, block=16)
    for got, ref in zip((col, row), want, strict=True):
        for x, y in ((got.sums, ref.sums), (got.bias_magnitude, ref.bias_magnitude)):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5 * float(y.abs().max()))


@pytest.mark.parametrize("gpu", TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_add_bias_equals_the_cpu_op(dtype, gpu):
    """700 columns in blocks of 64: 22 vectors, two passes of the CUDA products kernel."""
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(3, 300, 16, generator=g).to(dtype), torch.randn(16, 700, generator=g)
    bias = torch.randn(1400, generator=g).to(dtype)[::2]
    b = b.to(dtype)
    cpu = compiled.add_bias(compiled.encode_pair(a, b, 1.0, 64), bias, 300, 64)
    d = gpu.device
    with gpu.kernels():
        sums = compiled.encode_pair(a.to(d), b.to(d), 1.0, 64)
        got = compiled.add_bias(sums, bias.to(d), 300, 64)
        args = (*sums, bias.to(d), 300, 64)
        torch.library.opcheck(torch.ops.megatron_abft.add_bias.default, args)
    for x, want in zip(got, cpu, strict=True):
        torch.testing.assert_close(x.cpu(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("gpu", TARGETS)
@pytest.mark.parametrize("case", sorted(ENCODE_CASES))
def test_cuda_encode_pair_equals_the_cpu_one(case, gpu):
    a, b = (t.bfloat16() for t in ENCODE_CASES[case](torch.Generator().manual_seed(2)))
    cpu = compiled.encode_pair(a, b, 0.5, 64)
    with gpu.kernels():
        got = compiled.encode_pair(a.to(gpu.device), b.to(gpu.device), 0.5, 64)
    for x, want in zip(got, cpu, strict=True):
        torch.testing.assert_close(x.cpu(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@needs_ext
def test_the_kernel_selftest_passes_on_the_cpu_and_catches_a_wrong_kernel(monkeypatch):
    from megatron_abft.ops.selftest import mismatches

    assert mismatches(torch.device("cpu")) == []
    monkeypatch.setattr(
        compiled, "screen", lambda c, *args: torch.zeros(c.shape[:-2], dtype=torch.int32)
    )
    wrong = mismatches(torch.device("cpu"))
    assert (
        "screen, one fault (torch.float32)" in wrong
        and "screen, clean (torch.float32)" not in wrong
    )
    monkeypatch.undo()
    real = torch.ops.megatron_abft.add_bias

    def row_side_without_the_bias(col, col_magnitude, row, row_magnitude, bias, m, block):
        out = list(real(col, col_magnitude, row, row_magnitude, bias, m, block))
        out[2] = row
        return tuple(out)

    monkeypatch.setattr(torch.ops.megatron_abft, "add_bias", row_side_without_the_bias)
    assert mismatches(torch.device("cpu")) == [f"add_bias ({d})" for d in DTYPES[::2]]


@needs_ext
def test_a_device_whose_kernels_disagree_keeps_the_pytorch_path(monkeypatch):
    calls = []
    monkeypatch.setattr(compiled, "_trusted", {})
    monkeypatch.setattr(compiled, "_selftest", lambda device: calls.append(device) or ["screen"])
    device = torch.device("cuda", 7)
    with pytest.warns(RuntimeWarning, match=r"disagree .* on cuda:7 \(screen\)"):
        assert not compiled.trusted(device)
    assert not compiled.trusted(device) and calls == [device]  # tested once per device


@needs_cuda
def test_the_kernels_pass_their_selftest_on_the_gpu():
    from megatron_abft.ops.selftest import mismatches

    device = torch.device("cuda", torch.cuda.current_device())
    assert mismatches(device) == [] and compiled.trusted(device)
