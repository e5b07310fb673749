"""The checksum products on the tensor cores (csrc/bindings/abft_mma_products.cpp): a bf16
operand's products with fp32 checksum vectors split into three bf16 parts, as accurate as the
CUDA cores' row_products; taken by encode_pair and by the one-scratch check of a 2-D GEMM
(check_matrix_cuda, on a GPU and emulated) from 2^22 elements of the larger operand, where they
equal the composite's bit for bit, and a fault is still corrected."""

import pytest
import torch
from cuda_targets import TARGETS
from test_check_gemm import _arguments, _assert_same, _both
from test_ext import assert_sums_match, corrupted, needs_cuda, needs_emulator, needs_ext

from megatron_abft.ops import compiled

MIN_ELEMENTS = 1 << 22  # kMmaProductsMinElements (csrc/bindings/abft_binding.h)


def _vectors(k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """u (any sign, magnitudes from 1e-6 to 1e4) and z (non-negative, rows of a pair, as encoding
    reads the plain sums of magnitudes)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(5, k, generator=g) * 10.0 ** torch.randint(-6, 5, (5, k), generator=g)
    z = (torch.rand(3, 2, k, generator=g) * 300)[:, 0]
    return u, z


@needs_ext
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize("scale", [1.0, -0.125])
def test_mma_products_equal_the_fp64_products(scale, device):
    """As row_products: fp64's products within the rounding of k fp32 terms, scale applied; on
    a GPU, by its kernels and cuBLAS."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(70, 300, generator=g) * torch.logspace(-3, 3, 300)).bfloat16()
    u, z = _vectors(300, 1)
    products, magnitudes = torch.ops.megatron_abft.mma_products(
        x.to(device), u.to(device), z.to(device), scale
    )
    products, magnitudes = products.cpu(), magnitudes.cpu()
    xd = x.double()
    for got, want, bound in (
        (products, scale * xd @ u.double().T, abs(scale) * xd.abs() @ u.double().abs().T),
        (magnitudes, abs(scale) * xd.abs() @ z.double().T, abs(scale) * xd.abs() @ z.double().T),
    ):
        assert got.is_contiguous()
        assert_sums_match(got, want, bound, 300, torch.bfloat16)


@needs_ext
def test_the_three_parts_keep_all_but_an_fp32s_last_three_bits():
    """Products with the identity give the vectors back: hi + mid + lo is each entry within
    2^-27 of it, relative (one bf16 part alone would be 2^-9)."""
    u, z = _vectors(64, 2)
    eye = torch.eye(64, dtype=torch.bfloat16)
    products, magnitudes = torch.ops.megatron_abft.mma_products(eye, u, z)
    for got, want in ((products, u.T), (magnitudes, z.T)):
        assert ((got.double() - want.double()).abs() <= 2.0**-27 * want.double().abs()).all()
    lossy = (u.bfloat16().float() - u).abs().max() / u.abs().max()
    assert lossy > 2.0**-12  # the test's vectors need the parts


@needs_ext
def test_mma_products_refuse_what_they_do_not_take():
    x, (u, z) = torch.ones(4, 8, dtype=torch.bfloat16), _vectors(8, 3)
    for bad, message in (
        ((x.half(), u, z), "2-D bf16"),
        ((x[None], u, z), "2-D bf16"),
        ((x, u.double(), z), "fp32"),
        ((x, u[:, :4], z), r"fp32 \[r, 8\]"),
    ):
        with pytest.raises(RuntimeError, match=message):
            torch.ops.megatron_abft.mma_products(*bad)
    torch.library.opcheck(torch.ops.megatron_abft.mma_products.default, (x, u, z, -0.5))


@needs_emulator
@pytest.mark.parametrize("scale", [1.0, -0.125])
def test_the_cuda_kernels_split_and_sum_as_the_cpus_aten_ops(scale):
    """On a GPU (emulated) the vectors' split and the sums of the parts' products are a launch
    each (cuda_products.cuh's mma_parts and mma_sums; the two GEMMs and |x| between them): five in
    all, with results equal to the CPU's ATen ops bit for bit, vectors of any strides."""
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(70, 300, generator=g) * torch.logspace(-3, 3, 300)).bfloat16()
    u, z = _vectors(300, 8)
    u = torch.cat([u, u]).t().contiguous().t()[:5]  # rows 1 apart, entries 10 apart
    want = torch.ops.megatron_abft.mma_products(x, u, z, scale)
    with compiled.emulated_cuda():
        compiled.emulated_launches()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            got = torch.ops.megatron_abft.mma_products(x, u, z, scale)
        launched = [name.split("<")[0] for name in compiled.emulated_launches()]
    assert launched == ["mma_parts_kernel", "mma_sums_kernel"], launched
    op = "megatron_abft::mma_products"
    names = [e.name for e in profile.events() if e.cpu_parent and e.cpu_parent.name == op]
    assert names.count("aten::mm") == 2 and names.count("aten::abs") == 1, names
    for g_, w_ in zip(got, want, strict=True):
        assert g_.shape == w_.shape and g_.is_contiguous()
        assert torch.equal(g_, w_)


def _projection(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A projection's operands at the tensor cores' threshold: X [4096, 1024] and W^T [1024, 48]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(MIN_ELEMENTS // 1024, 1024, generator=g).bfloat16()
    return x, (torch.randn(48, 1024, generator=g) * 0.02).bfloat16().t()


def _ops(run) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        run()
    return [e.name for e in profile.events() if e.name.startswith("megatron_abft::")]


@needs_ext
def test_encode_pair_takes_the_tensor_cores_from_its_threshold_on():
    """encode_pair as a GPU runs it: at 2^22 elements both operands' products by mma_products,
    what the CPU's row products give; one row fewer, by row_products_pair."""
    x, w = _projection(4)
    want = compiled.encode_pair(x, w, 1.0, 256)  # the CPU: one pass over x
    split = torch.ops.megatron_abft.encode_pair_split
    ops = _ops(lambda: split(x, w, 1.0, 256))
    assert ops.count("megatron_abft::mma_products") == 2, ops
    assert "megatron_abft::row_products_pair" not in ops
    for got, w_ in zip(split(x, w, 1.0, 256), want, strict=True):
        assert got.dtype == w_.dtype and got.shape == w_.shape
        torch.testing.assert_close(got, w_, rtol=1e-5, atol=1e-5 * float(w_.abs().max()))
    mma, kernel = "megatron_abft::mma_products", "megatron_abft::row_products_pair"
    below = _ops(lambda: split(x[1:], w, 1.0, 256))  # one row under the threshold
    assert kernel in below and mma not in below
    assert mma not in _ops(lambda: split(x.half(), w.half(), 1.0, 256))


@pytest.mark.parametrize("gpu", TARGETS)
@pytest.mark.parametrize("kind, bias", [("none", True), ("value", False), ("nan", True)])
def test_a_large_projection_check_on_cuda_equals_its_composite(gpu, kind, bias):
    """The one-scratch check of a bf16 projection at the threshold, on a GPU as emulated: its
    products by the tensor cores on views of the scratch, results, ledger and output the
    composite's bit for bit; a clean output passes, a faulty element is corrected."""
    a, b = _projection(5)
    g = torch.Generator().manual_seed(6)
    bias_t = torch.randn(48, generator=g).bfloat16() if bias else None
    c = (-0.5 * (a.float() @ b.float()) + (0 if bias_t is None else bias_t.float())).bfloat16()
    faulty = corrupted(c.clone(), kind, "0d", "contiguous", 5)
    a, b, faulty = (t.to(gpu.device) for t in (a, b, faulty))
    bias_t = None if bias_t is None else bias_t.to(gpu.device)
    arguments = _arguments(faulty, a, b, bias_t, 256)
    with gpu.kernels():
        ops = _ops(lambda: _both(faulty, arguments, True))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            torch.ops.megatron_abft.check_gemm(faulty.clone(), *arguments)
        runs = _both(faulty, arguments, True)
    assert ops.count("megatron_abft::mma_products") == 2, ops  # the composite's; the op's inline
    # the op's own: two GEMMs an operand, on views of its scratch
    assert [e.name for e in profile.events()].count("aten::mm") == 4
    _assert_same(runs)
    _, out, ledger = runs[0]
    if kind == "none":
        assert int(ledger.counts.sum()) == 0 and torch.equal(out, faulty)
    else:  # detected and corrected
        assert ledger.counts.sum(1).tolist() == [1, 1, 0]
        torch.testing.assert_close(
            out.float().cpu(), c.float(), rtol=0, atol=0.02 * float(c.abs().max())
        )
