"""The checked GEMM (megatron_abft.ops.checked_gemm) in Triton's interpreter, on CPU tensors:
the same kernel source a GPU compiles. Its output equals the GEMM; a fault written into the
accumulator is flagged on its tile only, corrected by the tile's second pass when transient and
reported uncorrectable when it stays; the bound flags an error at twice its value and none on
clean data with heavy cancellation."""

import pytest
import torch

from megatron_abft.check.ledger import Ledger
from megatron_abft.config import KINDS
from megatron_abft.ops.checked_gemm import (
    INTERPRETED,
    checked_linear,
    tally,
    tiles_for,
    weight_sums,
)

CORRECTED, UNCORRECTABLE = 1, 2


def operands(m, n, k, dtype=torch.float32, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


def expected(x, w, b):
    y = x.double() @ w.double().T
    return y + b.double() if b is not None else y


def tile_of(row, col, n):
    """The code of element (row, col) of an output of ``n`` columns, for the interpreter's
    tiles: row block times the column blocks plus column block."""
    t = INTERPRETED
    return row // t.block_m * -(-n // t.block_n) + col // t.block_n


@pytest.mark.parametrize("shape", [(64, 64, 64), (70, 50, 40), (1, 33, 17)])
@pytest.mark.parametrize("bias", [True, False])
def test_the_output_is_the_gemm_and_clean_tiles_report_nothing(shape, bias):
    x, w, b = operands(*shape, bias=bias)
    y, codes = checked_linear(x, w, b)
    assert y.dtype == torch.float32 and y.shape == (shape[0], shape[1])
    torch.testing.assert_close(y.double(), expected(x, w, b), rtol=1e-5, atol=1e-5)
    assert codes.numel() == -(-shape[0] // 32) * -(-shape[1] // 32)
    assert codes.tolist() == [0] * codes.numel()
    plain, none = checked_linear(x, w, b, check=False)
    assert none.numel() == 0
    torch.testing.assert_close(plain, y, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_inputs_give_the_fp32_accumulated_product_rounded_once(dtype):
    x, w, b = operands(48, 40, 72, dtype)
    y, codes = checked_linear(x.view(4, 12, 72), w, b)
    assert y.dtype == dtype and y.shape == (4, 12, 40)
    assert codes.tolist() == [0] * codes.numel()
    torch.testing.assert_close(y.view(48, 40), expected(x, w, b).to(dtype), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(
    "value, kind",
    [(float("nan"), "nan"), (float("inf"), "inf"), (-3e20, "near_inf"), (40.0, "finite")],
)
@pytest.mark.parametrize("persistent", [False, True])
def test_a_fault_is_flagged_on_its_tile_and_corrected_unless_it_stays(value, kind, persistent):
    x, w, b = operands(70, 50, 40)
    clean, _ = checked_linear(x, w, b)
    row, col = 37, 41
    y, codes = checked_linear(x, w, b, fault=(row, col, value, persistent))
    outcome = UNCORRECTABLE if persistent else CORRECTED
    want = [0] * codes.numel()
    want[tile_of(row, col, 50)] = outcome << 2 | KINDS.index(kind)
    assert codes.tolist() == want
    if persistent:  # the fault stays in the output, reported
        assert not torch.equal(y[row, col], clean[row, col])
        y[row, col] = clean[row, col]
    torch.testing.assert_close(y, clean, rtol=0, atol=0)


def bound(x, w, b, row, col):
    """The kernel's bound for ``row`` of the column block holding ``col``, in float64."""
    t = INTERPRETED
    sums = weight_sums(w, t.block_n).double()
    block = col // t.block_n
    mass = x[row].double().abs() @ sums[block, 1]
    if b is not None:
        mass += b.double()[block * t.block_n : (block + 1) * t.block_n].abs().sum()
    g = 2 * (x.shape[1] + t.block_n + 2) * 2.0**-24  # the unfused checks' rounding factor
    return g * mass.item()


@pytest.mark.parametrize("factor, flagged", [(2.0, True), (0.25, False)])
def test_an_error_twice_the_bound_is_flagged_and_a_quarter_of_it_is_not(factor, flagged):
    x, w, b = operands(64, 64, 64)
    clean, _ = checked_linear(x, w, b)
    row, col = 5, 40
    value = clean[row, col].item() - (b[col].item()) + factor * bound(x, w, b, row, col)
    y, codes = checked_linear(x, w, b, fault=(row, col, value, True))
    want = [0] * codes.numel()
    if flagged:
        want[tile_of(row, col, 64)] = UNCORRECTABLE << 2 | KINDS.index("finite")
    assert codes.tolist() == want


def test_no_false_alarm_on_clean_data_with_heavy_cancellation():
    g = torch.Generator().manual_seed(3)
    # rows of large equal magnitude against weights summing near zero: |Y| << |X| |W|
    x = (1000 + torch.randn(96, 512, generator=g)).to(torch.float16)
    w = torch.randn(96, 512, generator=g)
    w = (w - w.mean(1, keepdim=True)).to(torch.float16)
    b = torch.randn(96, generator=g).to(torch.float16)
    for threshold_scale in (1.0, 0.05):
        _, codes = checked_linear(x, w, b, threshold_scale=threshold_scale)
        assert codes.tolist() == [0] * codes.numel()
    x32, w32 = x.float() * 1e-3, w.float() * 1e3
    _, codes = checked_linear(x32, w32, b.float(), threshold_scale=0.05)
    assert codes.tolist() == [0] * codes.numel()
    # values so large that their rounding alone is above near_inf: still within the bound
    x32, w32 = x.float() * 1e8, w.float() * 1e8
    y, codes = checked_linear(x32, w32, b.float())
    assert float(y.abs().max()) > 1e17 and codes.tolist() == [0] * codes.numel()


def test_weight_sums_are_each_column_blocks_sum_and_absolute_sum():
    w = torch.tensor([[1.0, -2.0], [3.0, 4.0], [-5.0, 6.0]])
    sums = weight_sums(w, 2)
    assert sums.shape == (2, 2, 2) and sums.dtype == torch.float32
    assert sums[0].tolist() == [[4.0, 2.0], [4.0, 6.0]]
    assert sums[1].tolist() == [[-5.0, 6.0], [5.0, 6.0]]


def test_weight_sums_of_16_bit_weights_are_exact():
    g = torch.Generator().manual_seed(9)
    w = torch.randn(70, 40, generator=g).to(torch.bfloat16)
    sums = weight_sums(w, 32)
    blocks = torch.nn.functional.pad(w.double(), (0, 0, 0, 26)).view(3, 32, 40)
    want = torch.stack((blocks.sum(1), blocks.abs().sum(1)), 1).float()
    assert torch.equal(sums, want)


def test_bad_inputs_are_refused_with_what_was_given():
    x, w, b = operands(8, 4, 6)
    with pytest.raises(ValueError, match="do not multiply"):
        checked_linear(x, w.T, b)
    with pytest.raises(ValueError, match="share one dtype"):
        checked_linear(x, w.double(), b)
    with pytest.raises(ValueError, match="bias"):
        checked_linear(x, w, b[:3])
    with pytest.raises(ValueError, match="sums"):
        checked_linear(x, w, b, sums=weight_sums(w[:, :5], INTERPRETED.block_n))


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_on_cuda_the_compiled_kernel_is_the_gemm_without_a_false_alarm(dtype):
    """GPT-3 350M's QKV projection at micro-batch 8 on the tensor cores: 1,536 tiles."""
    x, w, b = (t.cuda() for t in operands(16384, 3072, 1024, dtype))
    y, codes = checked_linear(x, w * 1024**-0.5, b)
    want = torch.addmm(b.float(), x.float(), (w * 1024**-0.5).float().T).to(dtype)
    torch.testing.assert_close(y, want, rtol=2e-2, atol=2e-2)
    assert codes.numel() == 128 * 24 and int(codes.count_nonzero()) == 0
    plain, _ = checked_linear(x, w * 1024**-0.5, b, check=False)
    assert torch.equal(plain, y)


@cuda
@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e20, 40.0])
@pytest.mark.parametrize("persistent", [False, True])
def test_on_cuda_a_fault_is_corrected_or_reported(value, persistent):
    x, w, b = (t.cuda() for t in operands(1000, 768, 512, torch.bfloat16))
    clean, _ = checked_linear(x, w, b)
    y, codes = checked_linear(x, w, b, fault=(700, 300, value, persistent))
    flagged = codes.nonzero().flatten().tolist()
    assert len(flagged) == 1
    assert int(codes[flagged[0]]) >> 2 == (UNCORRECTABLE if persistent else CORRECTED)
    if persistent:
        y[700, 300] = clean[700, 300]
    assert torch.equal(y, clean)


@pytest.mark.parametrize(
    "device, dtype",
    [("cpu", torch.float32), pytest.param("cuda", torch.bfloat16, marks=cuda)],
)
def test_megatrons_linear_function_with_the_checked_gemm_keeps_its_gradients(device, dtype):
    """layers.linear._CheckedLinear: the forward by the checked GEMM, Megatron's backward as is."""
    from megatron_abft.layers.linear import _CheckedLinear

    x, w, b = (t.to(device) for t in operands(96, 80, 48, dtype))
    leaves = [t.detach().requires_grad_() for t in (x, w, b)]
    sums = weight_sums(w, tiles_for(torch.device(device)).block_n)
    y, codes = _CheckedLinear.apply(*leaves, False, False, None, None, None, sums, 1.0, 1e10)
    assert int(codes.count_nonzero()) == 0 and not codes.requires_grad
    grad = torch.randn(96, 80, generator=torch.Generator().manual_seed(5)).to(device, dtype)
    y.backward(grad)
    reference = [t.detach().requires_grad_() for t in (x, w, b)]
    torch.nn.functional.linear(*reference).backward(grad)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(y, torch.nn.functional.linear(*reference), **tol)
    for got, want in zip(leaves, reference, strict=True):
        torch.testing.assert_close(got.grad, want.grad, **tol)


def logged(ledger):
    """The ledger's kept records, as lists of EVENT_FIELDS."""
    return ledger.log[: int(ledger.logged)].tolist()


def test_the_tally_counts_a_matrix_by_its_worst_tile_and_logs_where_it_began():
    ledger = Ledger.on(torch.device("cpu"), step=4)
    codes = torch.tensor([0, 5, 10, 10, 7], dtype=torch.int32)
    failed = tally(codes, 64, INTERPRETED, ledger)  # two column blocks of 32
    assert failed.dtype == torch.bool and bool(failed)
    # one matrix, an uncorrectable INF (code 10: the first of equals, tile 2: row 32, column 0)
    assert ledger.counts[:, KINDS.index("inf")].tolist() == [1, 0, 1]
    assert int(ledger.counts.sum()) == 2
    (record,) = logged(ledger)
    assert record[:6] == [4.0, UNCORRECTABLE, 0.0, KINDS.index("inf"), 32.0, 0.0]
    assert record[6] != record[6]  # no magnitude: NaN
    clean = tally(torch.zeros(7, dtype=torch.int32), 64, INTERPRETED, ledger)
    assert not bool(clean) and int(ledger.counts.sum()) == 2 and int(ledger.logged) == 1
    many = torch.zeros(2500, dtype=torch.int32)  # past one block of the kernel's reads
    many[2301], many[2400] = CORRECTED << 2 | 3, CORRECTED << 2 | 1
    assert not bool(tally(many, 96, INTERPRETED, ledger))  # three column blocks
    assert ledger.log[1, :6].tolist() == [4.0, CORRECTED, 0.0, 3, 2301 // 3 * 32, 2301 % 3 * 32]


def test_the_tally_of_a_batch_counts_each_matrix_and_logs_the_first_worst():
    ledger = Ledger.on(torch.device("cpu"), step=1, capacity=2)
    codes = torch.zeros(3, 11, 300, dtype=torch.int32)  # 33 matrices, past blocks of both
    codes[0, 4, 7] = CORRECTED << 2 | 2
    codes[1, 9, 299] = UNCORRECTABLE << 2 | 0
    codes[2, 10, 3] = UNCORRECTABLE << 2 | 3  # a later uncorrectable matrix: counted, not logged
    codes[2, 10, 250] = CORRECTED << 2 | 1  # the same matrix's lesser tile: not counted
    assert bool(tally(codes, 32, INTERPRETED, ledger))
    counts = ledger.counts.tolist()
    assert counts[0] == [1, 0, 1, 1] and counts[1] == [0, 0, 1, 0] and counts[2] == [1, 0, 0, 1]
    (record,) = logged(ledger)
    assert record[:6] == [1.0, UNCORRECTABLE, 20.0, 0.0, 299 * 32, 0.0]
    for _ in range(2):  # the log keeps its capacity and counts the rest
        tally(codes, 32, INTERPRETED, ledger)
    assert int(ledger.logged) == 3 and len(ledger.log) == 2
