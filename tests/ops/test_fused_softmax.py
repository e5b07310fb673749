"""The fused softmax (csrc/bindings/abft_softmax.cpp, megatron_abft.ops.fused_softmax): Megatron's
scale-mask-softmax with the scores' screen and the context operand's checksum pass in one read of S.
Against Megatron's own softmax, the screen op, operand_pass and encode: on CPU always, on CUDA
where a GPU is present."""

import pytest
import torch
from cuda_targets import TARGETS
from dispatched import Dispatched

from megatron_abft.check.checksum import encode, encode_from_pass
from megatron_abft.check.eec import CLEAN, CORRECTED, GemmOperands, verify_and_correct
from megatron_abft.check.sides import NO_SCREEN, Check, kernel_sides
from megatron_abft.check.tolerance import gemm_rounding
from megatron_abft.ops import compiled

pytestmark = pytest.mark.skipif(not compiled.available(), reason=compiled.backend())
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def megatron_softmax(s, mask, scale):
    """FusedScaleMaskSoftmax's torch path with softmax_in_fp32: mask True = masked out."""
    x = s.float() if s.dtype in (torch.bfloat16, torch.float16) else s
    x = x * scale
    if mask is not None:
        x = x.masked_fill(mask, -10000.0)
    return torch.softmax(x, -1).to(s.dtype)


def scores_case(batch, sq, sk, hn, dtype, device, seed=0, alpha=0.25, block=16):
    """Q, K and S = alpha Q K^T in ``dtype``, with the screen's sides for S in blocks of
    ``block``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*batch, sq, hn, generator=g).to(dtype).to(device)
    k = torch.randn(*batch, sk, hn, generator=g).to(dtype).to(device)
    s = torch.matmul(q, k.mT) * alpha
    col, row = encode(q, k.mT, alpha=alpha, block=block)
    check = Check(gemm_rounding(s.dtype, s.device), 1.0, 1e10, 0, None)
    return q, k, s, kernel_sides(s, {"col": col, "row": row}, check)


def masks(kind, batch, sq, sk, device):
    if kind == "none":
        return None, False, None
    causal = torch.ones(sq, sk, dtype=torch.bool, device=device).triu(1)
    if kind == "causal":
        return None, True, causal
    padded = causal.expand(batch[0], 1, sq, sk).clone()
    padded[0, ..., -3:] = True  # the first sequence's last keys are padding
    padded = padded.reshape(batch[0], 1, sq, sk).expand(*batch, sq, sk)
    return padded, False, padded


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_kind", ["none", "causal", "padding"])
@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_probabilities_equal_megatrons_softmax(device, dtype, mask_kind, scale):
    batch, sq, sk = (2, 3), 37, 37
    _, _, s, sides = scores_case(batch, sq, sk, 8, dtype, device)
    mask, causal, full = masks(mask_kind, batch, sq, sk, device)
    for screen in (sides, NO_SCREEN):
        p, flagged, *rest = compiled.softmax_check(s, screen, mask, causal, scale, 16, None)
        want = megatron_softmax(s, full, scale)
        assert p.dtype == dtype and p.shape == s.shape and p.is_contiguous()
        tol = {torch.float64: 1e-13, torch.float32: 3e-7}.get(dtype)
        torch.testing.assert_close(p, want, rtol=tol, atol=tol)
        assert flagged.shape == batch and not flagged.any()
        assert all(t.numel() == 0 for t in rest)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_nan_score_makes_its_row_nan_as_megatrons_softmax_does(device, dtype):
    """A NaN in S is not hidden: its row of P is NaN, masked entries included (torch's softmax);
    the CPU's fast exp once made it a probability of 0 and the row finite."""
    batch, sq = (2, 3), 24
    _, _, s, _ = scores_case(batch, sq, sq, 8, dtype, device)
    s[1, 2, 5, 3] = float("nan")
    mask, causal, full = masks("causal", batch, sq, sq, device)
    p = compiled.softmax_check(s, NO_SCREEN, mask, causal, 1.0, 16, None)[0]
    want = megatron_softmax(s, full, 1.0)
    assert torch.equal(p.isnan(), want.isnan()) and int(p.isnan().sum()) == sq
    torch.testing.assert_close(p.nan_to_num(), want.nan_to_num())


def faulty_scores(s, seed):
    """S with a fault in some matrices: a large finite value, an INF, a NaN, a row shift."""
    s = s.clone()
    g = torch.Generator().manual_seed(seed)
    flat = s.view(-1, *s.shape[-2:])
    picks = torch.randperm(flat.shape[0], generator=g)[:4].tolist()
    i, j = (int(torch.randint(n, (1,), generator=g)) for n in s.shape[-2:])
    flat[picks[0], i, j] += 1000.0
    flat[picks[1], i, j] = float("inf")
    flat[picks[2], i, j] = float("nan")
    flat[picks[3], i, :] += 1.0
    return s


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(3))
def test_flagged_counts_equal_the_screen(device, dtype, seed):
    """Per matrix, the fused screen flags exactly the vectors the screen op flags."""
    _, _, s, sides = scores_case((3, 2), 40, 33, 8, dtype, device, seed=seed)
    bad = faulty_scores(s, seed)
    for case in (s, bad):
        _, flagged, *_ = compiled.softmax_check(case, sides, None, True, 1.0, 16, None)
        assert torch.equal(flagged, compiled.screen(case, *sides))
    assert (flagged > 0).sum() == 4


def assert_close_to_sums(got, want, sizes, dtype):
    """Equal to rounding: two orders of summing the same terms in the accumulation dtype."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert got.dtype == want.dtype == acc and got.shape == want.shape
    bound = 64 * torch.finfo(acc).eps * sizes.abs() + torch.finfo(acc).tiny
    assert ((got - want).abs() <= bound).all()


def pass_sizes(found, p, u):
    """The sums of the magnitudes of the terms of P's pass's outputs (found: block sums, their
    magnitudes, products, magnitudes' products), which bound their rounding: P is non-negative,
    so its sums are their own, but a product with the signed u cancels; its bound is |P| |u|^T."""
    sums, sizes, products, magnitudes = found
    terms = (p.double().abs() @ u.double().abs().mT).to(products.dtype)
    return sizes, sizes, terms, magnitudes


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rep", [1, 3])
def test_p_pass_and_context_references_equal_encode(device, dtype, rep):
    """P's pass is operand_pass of the P written; the context's references from it equal
    encode(P, V), V shared by the heads of a KV group (GQA)."""
    b, groups, sq, sk, hn = 2, 2, 45, 45, 20
    _, _, s, sides = scores_case((b, groups, rep), sq, sk, 8, dtype, device)
    g = torch.Generator().manual_seed(1)
    v = torch.randn(b, groups, 1, sk, hn, generator=g).to(dtype).to(device)
    vectors = compiled.pair_vectors(s, v, 16)
    p, flagged, *found = compiled.softmax_check(s, sides, None, True, 1.0, 16, vectors)
    assert not flagged.any()
    direct = torch.ops.megatron_abft.operand_pass(p, 16, *vectors, 1.0)
    for got, want in zip(found, direct, strict=True):
        assert_close_to_sums(got, want, want, dtype)
    col, row = encode_from_pass(p, v, 16, tuple(found))
    want_col, want_row = encode(p, v, block=16)
    for got, want in ((col, want_col), (row, want_row)):
        assert (got.block, got.length, got.inner) == (want.block, want.length, want.inner)
        assert_close_to_sums(got.sums, want.sums, want.magnitude.unsqueeze(-2), dtype)
        assert_close_to_sums(got.magnitude, want.magnitude, want.magnitude, dtype)
    # the context checks clean against them, and a fault in it is corrected
    c = torch.matmul(p, v)
    clean = c.clone()
    result = verify_and_correct(c, col, row, operands=GemmOperands(p, v))
    assert (result.status == CLEAN).all() and torch.equal(c, clean)
    c[1, 0, 0, 7, 3] += 100.0
    result = verify_and_correct(c, col, row, operands=GemmOperands(p, v))
    assert (result.status == CORRECTED).sum() == 1
    torch.testing.assert_close(c, clean, rtol=0, atol=float(clean.abs().max()) * 2e-2)


@pytest.mark.parametrize("mask_kind", ["none", "causal", "padding"])
def test_gradient_is_megatrons(mask_kind):
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import attention_mask_func

    from megatron_abft.ops import fused_softmax

    batch, sq = (2, 3), 24
    _, _, s, sides = scores_case(batch, sq, sq, 8, torch.float64, "cpu")
    mask, causal, full = masks(mask_kind, batch, sq, sq, "cpu")
    module = FusedScaleMaskSoftmax(
        input_in_fp16=False,
        input_in_bf16=False,
        attn_mask_type=AttnMaskType.causal if causal else AttnMaskType.padding,
        scaled_masked_softmax_fusion=False,
        mask_func=attention_mask_func,
        softmax_in_fp32=True,
        scale=0.5,
    )
    x = s.clone().requires_grad_()
    assert fused_softmax.fusable(module, x, mask, None)
    p = fused_softmax.softmax(module, x, mask, sides, 16, None)[0]
    weight = torch.randn_like(p)
    with Dispatched() as backward:
        (p * weight).sum().backward()
    # the findings the softmax returns beside P have no gradient: none is made for them
    assert not [op for op in backward.ops if "zeros" in op], backward.ops
    y = s.clone().requires_grad_()
    want = megatron_softmax(y, full, 0.5)
    (want * weight).sum().backward()
    torch.testing.assert_close(p, want)
    torch.testing.assert_close(x.grad, y.grad)
    corner = None if mask is None else mask[:1, :1, -6:, -6:]  # padding in the last keys
    torch.autograd.gradcheck(
        lambda t: fused_softmax.softmax(module, t, corner, NO_SCREEN, 16, None)[0],
        (s[:1, :1, -6:, -6:].clone().requires_grad_(),),
    )
    # what it refuses: an offset, a mask it cannot read, a non-causal rectangle it would mask
    assert not fused_softmax.fusable(module, x, None, torch.zeros(3))
    assert not fused_softmax.fusable(module, x, torch.zeros(1, 1, sq, sq), None)


def test_bad_inputs_are_refused_with_what_is_wrong():
    _, _, s, sides = scores_case((2,), 20, 20, 8, torch.float32, "cpu")
    v = torch.randn(2, 20, 6)
    u, z = compiled.pair_vectors(s, v, 16)
    op = torch.ops.megatron_abft.softmax_check

    def args(s=s, sides=NO_SCREEN, mask=None, u=None, z=None):
        return (s, *sides, mask, False, 1.0, 16, u, z)

    cases = {
        "mask must be a bool": args(mask=(s > 0).to(torch.uint8)),
        "does not broadcast": args(mask=torch.zeros(3, 20, 20, dtype=torch.bool)),
        "contiguous rows": args(s=s.mT),
        "both u and z": args(u=u),
        "must be equal": args(sides=(32, 0, sides[2], [], sides[4], []), u=u, z=z),
        "both blocks are 0": args(sides=(0, 0, sides[2], [], [], [])),
        "must be fp32, fp64, bf16 or fp16": args(s=s.to(torch.int8)),
    }
    for message, arguments in cases.items():
        with pytest.raises(RuntimeError, match=message):
            op(*arguments)
    with pytest.raises(RuntimeError, match="must be the larger operand"):
        torch.ops.megatron_abft.pair_vectors(v.mT, s, 16)


def test_opcheck_schemas_and_fakes():
    _, _, s, sides = scores_case((2,), 20, 20, 8, torch.float32, "cpu")
    v = torch.randn(2, 20, 6)
    u, z = compiled.pair_vectors(s, v, 16)
    op = torch.ops.megatron_abft
    mask = torch.ones(20, 20, dtype=torch.bool).triu(1)
    torch.library.opcheck(op.softmax_check.default, (s, *sides, mask, False, 0.5, 16, u, z))
    torch.library.opcheck(
        op.softmax_check.default, (s, *NO_SCREEN, None, True, 1.0, 16, None, None)
    )
    torch.library.opcheck(op.pair_vectors.default, (s, v, 16))
    p, _, *found = compiled.softmax_check(s, sides, None, True, 1.0, 16, (u, z))
    torch.library.opcheck(op.encode_pair_from.default, (p, v, 1.0, 16, *found[:2]))


@pytest.mark.parametrize("gpu", TARGETS)
@pytest.mark.parametrize(
    "sq, sk",
    [
        (50, 50),  # the single pass
        (20, 3000),  # the single pass, with more than 48 KiB of shared memory
        (20, 4100),  # a band's column sums too large for it: the composed kernels
    ],
)
def test_cuda_equals_cpu(sq, sk, gpu):
    """The CUDA kernel flags what the CPU's flags and writes P equal to rounding (their exps
    differ by ulps); its pass equals operand_pass of the P it wrote, with the vectors it read
    (pair_vectors' on that device: u's sums cancel, so the two devices' u differ by more than
    the pass's own rounding)."""
    _, _, s, sides = scores_case((2, 3), sq, sk, 8, torch.float32, "cpu")
    v = torch.randn(2, 3, sk, 16, generator=torch.Generator().manual_seed(2))
    bad = faulty_scores(s, 0)

    def run(device):
        moved = [t.to(device) for t in (bad, v)]
        screen = (*sides[:2], *[[t.to(device) for t in side] for side in sides[2:4]], *sides[4:])
        vectors = compiled.pair_vectors(moved[0], moved[1], 16)
        causal = sq == sk  # long rows unmasked, so that P is not mostly zeros
        found = compiled.softmax_check(moved[0], screen, None, causal, 1.0, 16, vectors)
        return [t.cpu() for t in (*found, *vectors)]

    cpu = run("cpu")
    with gpu.kernels():
        gpu = run(gpu.device)
    assert torch.equal(cpu[1], gpu[1]) and (cpu[1] > 0).sum() == 4
    clean = cpu[1].view(-1) == 0  # the flagged matrices' P is NaN where S is

    def of_clean(t):
        return t.flatten(0, 1)[clean]

    torch.testing.assert_close(of_clean(cpu[0]), of_clean(gpu[0]))
    vectors = gpu[6:]
    direct = torch.ops.megatron_abft.operand_pass(gpu[0], 16, *vectors, 1.0)
    sizes = pass_sizes(direct, gpu[0], vectors[0])
    for got, want, size in zip(gpu[2:6], direct, sizes, strict=True):
        assert_close_to_sums(of_clean(got), of_clean(want), of_clean(size), torch.float32)


@pytest.mark.parametrize("gpu", TARGETS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "padding"])
@pytest.mark.parametrize(
    "sq, sk, block",
    [
        (140, 260, 128),  # two bands, the second of 12 rows; S's row blocks of one slot; a
        # part-filled slot (65 vectors a row)
        (20, 2048, 256),  # bf16, fp16: every slot of every lane (fp32: too long, the other kernel)
    ],
)
def test_the_rows_in_registers_kernel_equals_the_cpu_op(gpu, dtype, mask_kind, sq, sk, block):
    """The single pass's kernel for rows that fit a warp's registers (softmax_rows_kernel):
    the CPU op's flags (of S's block sums, on both sides), P equal to rounding, P's pass equal
    to operand_pass of the P it wrote; with every mask (the padding mask read a word at a
    time)."""
    _, _, s, sides = scores_case((2, 3), sq, sk, 8, dtype, "cpu", block=block)
    v = torch.randn(2, 3, sk, 16, generator=torch.Generator().manual_seed(2)).to(dtype)
    bad = faulty_scores(s, 0)
    mask, causal, full = masks(mask_kind, (2, 3), sq, sk, "cpu")

    def run(device):
        moved = [t.to(device) for t in (bad, v)]
        screen = (*sides[:2], *[[t.to(device) for t in side] for side in sides[2:4]], *sides[4:])
        vectors = compiled.pair_vectors(moved[0], moved[1], block)
        on = None if mask is None else mask.to(device)
        found = compiled.softmax_check(moved[0], screen, on, causal, 0.3, block, vectors)
        return [t.cpu() for t in (*found, *vectors)]

    cpu = run("cpu")
    with gpu.kernels():
        got = run(gpu.device)
        if gpu.emulated:  # the last launch is the softmax's
            kernel = compiled.emulated_launches()[-1]
            fits = dtype != torch.float32 or sk <= 1024
            assert kernel.startswith("softmax_rows_kernel" if fits else "softmax_pass_kernel")
    assert torch.equal(cpu[1], got[1]) and (cpu[1] > 0).sum() == 4
    clean = cpu[1].view(-1) == 0  # the flagged matrices' P is NaN where S is

    def of_clean(t):
        return t.flatten(0, 1)[clean]

    tolerance = {torch.float32: {}}.get(dtype, {"rtol": 0.0, "atol": float(torch.finfo(dtype).eps)})
    torch.testing.assert_close(of_clean(got[0]), of_clean(cpu[0]), **tolerance)
    vectors = got[6:]
    direct = torch.ops.megatron_abft.operand_pass(got[0], block, *vectors, 1.0)
    sizes = pass_sizes(direct, got[0], vectors[0])
    for found, want, size in zip(got[2:6], direct, sizes, strict=True):
        assert_close_to_sums(of_clean(found), of_clean(want), of_clean(size), torch.float32)


@needs_cuda
@pytest.mark.parametrize("screened", [False, True])
def test_the_single_pass_is_one_launch(screened):
    """On CUDA, the fused softmax is one kernel (and, with a screen, the sum of its bands' slots):
    the GPU's sync-free attention asks for P's pass alone."""
    _, _, s, sides = scores_case((2, 3), 64, 64, 8, torch.bfloat16, "cuda")
    v = torch.randn(2, 3, 64, 16, device="cuda").to(torch.bfloat16)
    vectors = compiled.pair_vectors(s, v, 16)
    screen = sides if screened else NO_SCREEN
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        _, flagged, *_ = compiled.softmax_check(s, screen, None, True, 1.0, 16, vectors)
        torch.cuda.synchronize()
    kernels = [e for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == (2 if screened else 1), [e.name for e in kernels]
    assert not flagged.any()


@needs_cuda
def test_the_context_references_from_the_pass_are_two_launches():
    """On CUDA, the context's references in the fused path are pair_vectors' launch and
    encode_pair_from's (the row side is views of P's pass), as many as encode_pair's: what
    scaling.FUSED_CONTEXT_OPS counts."""
    _, _, s, sides = scores_case((2, 2, 3), 64, 64, 8, torch.bfloat16, "cuda")
    v = torch.randn(2, 2, 1, 64, 16, device="cuda").to(torch.bfloat16)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]

    def launches(work):
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=activities) as profile:
            out = work()
            torch.cuda.synchronize()
        cuda = torch.autograd.DeviceType.CUDA
        return out, [e.name for e in profile.events() if e.device_type == cuda]

    vectors, first = launches(lambda: compiled.pair_vectors(s, v, 16))
    p, _, *found = compiled.softmax_check(s, NO_SCREEN, None, True, 1.0, 16, vectors)
    (_, row), second = launches(lambda: encode_from_pass(p, v, 16, tuple(found)))
    assert (len(first), len(second)) == (1, 1), (first, second)
    assert row.sums.data_ptr() == found[2].data_ptr()  # a view of P's pass, not a copy


def test_the_kernel_selftest_checks_the_softmax(monkeypatch):
    from megatron_abft.ops.selftest import mismatches

    assert mismatches(torch.device("cpu")) == []
    real = torch.ops.megatron_abft.softmax_check

    def blind_and_unmasked(s, col_block, row_block, col, row, col_bounds, row_bounds, mask, *rest):
        out = list(
            real(s, col_block, row_block, col, row, col_bounds, row_bounds, None, False, *rest[1:])
        )
        out[1] = torch.zeros_like(out[1])
        return tuple(out)

    monkeypatch.setattr(torch.ops.megatron_abft, "softmax_check", blind_and_unmasked)
    wrong = mismatches(torch.device("cpu"))
    for dtype in (torch.float32, torch.bfloat16):
        assert f"softmax_check, screen one fault ({dtype})" in wrong
        assert f"softmax_check, probabilities ({dtype})" in wrong
        assert f"softmax_check, screen clean ({dtype})" not in wrong
