import pytest
import torch

from megatron_abft.check.checksum import encode, encode_columns, encode_rows, nblocks
from megatron_abft.ops import compiled


def exact_product(a, b, alpha, bias):
    c = alpha * (a.double() @ b.double())
    return c if bias is None else c + bias.double()


def blocked_sums(c, block):
    """Plain and weighted sums of each column of c over row blocks, in fp64."""
    m = c.shape[-2]
    out = []
    for start in range(0, m, block):
        part = c[..., start : start + block, :]
        w = torch.arange(1, part.shape[-2] + 1, dtype=torch.float64).unsqueeze(-1)
        out.append(torch.stack([part.sum(-2), (w * part).sum(-2)], -2))
    return torch.stack(out, -3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m, k, n, block", [(1, 1, 1, 2), (37, 5, 53, 16), (130, 64, 7, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_both_sides_equal_the_sums_of_the_exact_product(dtype, m, k, n, block, with_bias):
    g = torch.Generator().manual_seed(m * n + k)
    a = torch.randn(2, 3, m, k, generator=g).to(dtype)
    b = torch.randn(3, k, n, generator=g).to(dtype)  # broadcast over the first batch dim
    bias = torch.randn(n, generator=g).to(dtype) if with_bias else None
    col, row = encode(a, b, alpha=0.5, bias=bias, block=block)
    exact = exact_product(a, b, 0.5, bias)
    assert col.sums.dtype == torch.float32 and col.sums.shape == (2, 3, nblocks(m, block), 2, n)
    assert row.sums.shape == (2, 3, nblocks(n, block), 2, m)
    for got, c in ((col, exact), (row, exact.mT)):
        want = blocked_sums(c, block)
        scale = blocked_sums(c.abs(), block)[..., :1, :] * block + 1
        assert ((got.sums.double() - want).abs() <= 1e-5 * scale).all()
        # the magnitude bounds the absolute values of the block's entries
        assert (
            got.magnitude.double() >= blocked_sums(c.abs(), block)[..., 0, :] * (1 - 1e-5)
        ).all()


def test_fp64_inputs_keep_fp64_checksums():
    a, b = torch.randn(4, 3, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    col = encode_columns(a, b, block=2)
    assert col.sums.dtype == torch.float64
    torch.testing.assert_close(col.sums, blocked_sums(a @ b, 2), rtol=1e-12, atol=1e-12)


def test_encoding_never_tracks_gradients():
    a = torch.randn(8, 4, requires_grad=True)
    b = torch.randn(4, 6, requires_grad=True)
    assert not encode_rows(a, b, block=4).sums.requires_grad


@pytest.mark.parametrize(
    "a, b, kwargs, error, message",
    [
        (torch.ones(3, 4), torch.ones(5, 2), {}, ValueError, "inner dimensions differ"),
        (torch.ones(3, 4, dtype=torch.int32), torch.ones(4, 2), {}, TypeError, "a must be fp64"),
        (torch.ones(2, 3, 4), torch.ones(3, 4, 2), {}, ValueError, "do not broadcast"),
        (torch.ones(4), torch.ones(4, 2), {}, ValueError, "at least 2 dims"),
        (torch.ones(3, 4), torch.ones(4, 2), {"block": 1}, ValueError, "block must be an int >= 2"),
        (torch.ones(3, 4), torch.ones(4, 2), {"bias": torch.ones(3)}, ValueError, "bias must have"),
        (
            torch.ones(3, 4),
            torch.ones(4, 2, device="meta"),
            {},
            ValueError,
            "put both on one device",
        ),
    ],
)
def test_bad_operands_raise_clear_errors(a, b, kwargs, error, message):
    with pytest.raises(error, match=message):
        encode(a, b, **kwargs)


def test_a_bias_adds_a_few_ops_to_the_encoding():
    """On the PyTorch path, the bias's terms in the checksums come from constants made once per
    shape (each block's row count and weight sum): a few elementwise ops and one small GEMM per
    side, not the constants rebuilt on every check (on a GPU every op is a kernel launch). The
    kernels take one op (tests/ops/test_ext.py)."""
    a, w, bias = torch.randn(64, 32), torch.randn(96, 32), torch.randn(96)

    def ops(bias):
        cpu = [torch.profiler.ProfilerActivity.CPU]
        with compiled.disabled():
            encode(a, w.t(), bias=bias, block=16)  # makes the constants
            with torch.profiler.profile(activities=cpu, acc_events=True) as p:
                col, row = encode(a, w.t(), bias=bias, block=16)
        names = [e.name for e in p.events() if e.cpu_parent is None and "::" in e.name]
        return [n for n in names if n not in VIEWS], col, row

    without, *_ = ops(None)
    with_bias, col, row = ops(bias)
    assert len(with_bias) - len(without) <= 12, with_bias
    assert not {"aten::arange", "aten::ones", "aten::stack"} & set(with_bias)
    want = exact_product(a, w.t(), 1.0, bias)
    torch.testing.assert_close(col.sums.double(), blocked_sums(want, 16), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(row.sums.double(), blocked_sums(want.mT, 16), rtol=1e-5, atol=1e-4)


VIEWS = {
    "aten::t",
    "aten::mT",
    "aten::detach",
    "aten::select",
    "aten::unsqueeze",
    "aten::unflatten",
}


def test_constants_are_kept_only_where_they_hold_their_values():
    """block_weights and the bias's block counts are made once and kept, but never a fake
    tensor of a torch.compile trace (it has no values); the next test covers CUDA graphs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_abft.check.checksum import _CONSTANTS, _block_counts, block_weights

    cpu = torch.device("cpu")
    with FakeTensorMode():
        fake = block_weights(48, cpu, torch.float32)
    assert type(fake) is not torch.Tensor and ("weights", 48, cpu, torch.float32) not in _CONSTANTS
    kept = block_weights(48, cpu, torch.float32)
    assert block_weights(48, cpu, torch.float32) is kept
    assert kept.tolist() == [[1.0] * 48, [float(i) for i in range(1, 49)]]
    counts = _block_counts(100, 48, cpu, torch.float32)
    assert counts.flatten().tolist() == [48, 48 * 49 / 2, 48, 48 * 49 / 2, 4, 10]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_constants_made_while_a_cuda_graph_is_captured_are_not_kept():
    from megatron_abft.check.checksum import _CONSTANTS, _block_counts

    gpu = torch.device("cuda", torch.cuda.current_device())
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        _block_counts(77, 16, gpu, torch.float32)
    assert ("counts", 77, 16, gpu, torch.float32) not in _CONSTANTS
    assert _block_counts(77, 16, gpu, torch.float32)[-1].flatten().tolist() == [13, 91]
