"""SectionGuard.check_read with the fused softmax as the reader of the scores (ops.fused_softmax's
SoftmaxReader): the same P as Megatron's softmax of the clean scores, and the same counts, on
each route the guard takes: Megatron's softmax of S checked first; S checked apart, then read by
the fused softmax without a screen (the CPU's); the fused softmax's screen with the host reading its
flags (a GPU's check that reads the host, taken here on the CPU by patching checks_apart); and the
fused softmax correcting and tallying the flagged matrices itself (a GPU's sync-free check, taken
here on the CPU by patching host_reads)."""

import pytest
import torch
from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import attention_mask_func

from megatron_abft.check.checksum import encode
from megatron_abft.check.eec import KINDS, GemmOperands
from megatron_abft.config import ABFTConfig
from megatron_abft.ops import compiled, fused_softmax
from megatron_abft.runtime import guard as guard_module
from megatron_abft.runtime.guard import SectionGuard

pytestmark = pytest.mark.skipif(not compiled.available(), reason=compiled.backend())
ALPHA = 0.25
S = 40
MASK = torch.ones(S, S, dtype=torch.bool).triu(1)[None, None]  # causal; True: masked out


def megatron_module() -> FusedScaleMaskSoftmax:
    return FusedScaleMaskSoftmax(
        input_in_fp16=False,
        input_in_bf16=False,
        attn_mask_type=AttnMaskType.causal,
        scaled_masked_softmax_fusion=False,
        mask_func=attention_mask_func,
        softmax_in_fp32=True,
        scale=None,
    )


def attention_case(seed=0):
    """Q [b, ng, rep, s, hn], K and V [b, ng, 1, s, hn] and S = ALPHA Q K^T."""
    g = torch.Generator().manual_seed(seed)
    b, groups, rep, s, hn = 2, 2, 2, S, 16
    q = torch.randn(b, groups, rep, s, hn, generator=g)
    k, v = (torch.randn(b, groups, 1, s, hn, generator=g) for _ in range(2))
    return GemmOperands(q, k.mT, ALPHA), v, ALPHA * (q @ k.mT)


def read(scores, operands, v, config, route, monkeypatch, with_pass=True):
    """The guard's read of ``scores`` by the fused softmax (or Megatron's softmax where ``route`` is
    "megatron"): P [b, np, sq, sk], the context's references, the guard."""
    monkeypatch.setattr(guard_module, "host_reads", lambda *_: route != "sync-free")
    if route == "host":
        monkeypatch.setattr(guard_module, "checks_apart", lambda *_: False)
    if route == "megatron":
        config.fused_softmax = False
    guard = SectionGuard("scores", config, 0)
    module = megatron_module()
    values = v if with_pass else None
    reader = fused_softmax.SoftmaxReader.of(module, scores, MASK, None, values, config)
    assert reader.fused == (route != "megatron")
    probs, refs = guard.check_read(scores, operands, reader, recompute=lambda: scores)
    return probs, refs, guard


def megatron_probs(scores):
    b, groups, rep, sq, sk = scores.shape
    return megatron_module()(scores.view(b, groups * rep, sq, sk).clone(), MASK, None)


ROUTES = ["megatron", "apart", "host", "sync-free"]


@pytest.mark.parametrize("route", ROUTES)
def test_clean_scores_are_read_as_megatrons_softmax(route, monkeypatch):
    operands, v, scores = attention_case()
    probs, refs, guard = read(scores.clone(), operands, v, ABFTConfig(), route, monkeypatch)
    torch.testing.assert_close(probs, megatron_probs(scores))
    assert not guard.ledger.counts.any()
    assert guard.pending is None or not bool(guard.pending)
    if route == "megatron":
        assert refs is None  # the context encodes its own references
        return
    p5 = probs.view(scores.shape)
    for got, want in zip(refs, encode(p5, v, block=ABFTConfig().block_size), strict=True):
        torch.testing.assert_close(got.sums, want.sums, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("route", ROUTES)
def test_a_fault_in_the_scores_is_corrected_before_p_is_read(route, monkeypatch):
    operands, v, clean = attention_case(seed=1)
    scores = clean.clone()
    scores[1, 0, 1, 17, 5] += 1000.0
    probs, _, guard = read(scores, operands, v, ABFTConfig(), route, monkeypatch)
    unmasked = ~MASK[0, 0]  # Megatron's softmax writes its mask into S
    torch.testing.assert_close(scores[..., unmasked], clean[..., unmasked])
    torch.testing.assert_close(probs, megatron_probs(clean), rtol=1e-5, atol=1e-6)
    assert int(guard.ledger.counts[1].sum()) == 1  # one matrix corrected
    assert not bool(guard.pending)


@pytest.mark.parametrize("route", ROUTES)
def test_an_uncorrectable_fault_is_pending(route, monkeypatch):
    """A block of NaN in S that no side can rebuild: counted uncorrectable and pending for the
    policy, on every route."""
    operands, v, scores = attention_case(seed=2)
    scores[0, 1, 0, 10:20, 10:20] = float("nan")
    config = ABFTConfig(on_uncorrectable="log")
    _, _, guard = read(scores, operands, v, config, route, monkeypatch)
    assert int(guard.ledger.counts[2, KINDS.index("nan")]) == 1
    assert bool(guard.pending)


def test_fused_softmax_reads_only_with_work_to_do(monkeypatch):
    """Not due and no pass to make: Megatron's softmax reads S, nothing is checked."""
    operands, v, scores = attention_case()
    config = ABFTConfig(sections=("qkv",))
    probs, refs, guard = read(scores, operands, v, config, "host", monkeypatch, with_pass=False)
    assert refs is None and guard.ledger is None
    torch.testing.assert_close(probs, megatron_probs(scores))


def test_on_the_cpu_the_scores_are_checked_apart_in_one_call():
    """The CPU's route, unpatched: after a signature's first check (the reference's), a clean S
    is checked by check_gemm's screen alone (compiled.screen_passes, one call and no op) and the
    fused softmax reads it without a screen, so nothing encodes the screen's references."""
    operands, v, scores = attention_case()
    guard, module = SectionGuard("scores", ABFTConfig(), 0), megatron_module()

    def check():
        reader = fused_softmax.SoftmaxReader.of(module, scores, MASK, None, None, ABFTConfig())
        return guard.check_read(scores, operands, reader, recompute=lambda: scores)

    check()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        probs, refs = check()
    ran = {e.name for e in prof.events() if e.name.startswith("megatron_abft::")}
    assert ran == {"megatron_abft::softmax_check"} and refs is None
    torch.testing.assert_close(probs, megatron_probs(scores))
