"""The protected flash attention computes attention: output and dQ, dK, dV against a float64
reference, within FlashAttention's rule (at most 2x the error of the same-precision PyTorch
attention; bf16 against a bf16 baseline), clean checks raising nothing. Triton's interpreter,
on CPU, at small shapes; one process."""

import math

import pytest
import torch
from flash_cases import DEVICE, attention, errors, inputs, outputs, run

from megatron_abft.faults import TensorFault
from megatron_abft.flash import FlashFault, flash_attention, launch

SEQS = (1, 17, 129, 256)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HEADS = ((4, 4), (4, 2), (4, 1))  # MHA, GQA, MQA


def _cases():
    """Every sequence length with every dtype; head dim, causal and the head layout rotate so
    that each dtype meets both head dims, both masks (in all four pairs) and all three
    layouts."""
    for i, seq in enumerate(SEQS):
        for j, dtype in enumerate(DTYPES):
            yield pytest.param(
                seq,
                (64, 128)[(i + j) % 2],
                dtype,
                (True, False)[(i // 2 + j) % 2],
                HEADS[(i + 2 * j) % 3],
                id=f"seq{seq}-{str(dtype)[6:]}",
            )


def assert_within_the_rule(q, k, v, do, causal, scale, **options):
    """The flash attention's output and gradients, each within 2x the error of the same
    PyTorch attention in the inputs' dtype against float64 (plus a floor of a few fp32
    roundings, where PyTorch's own error is at that level), and its checks clean."""

    def reference(a, b, c):
        return attention(a, b, c, causal, scale)

    exact = outputs(reference, q, k, v, do, torch.float64)
    baseline = errors(outputs(reference, q, k, v, do), exact)
    got, ledger = run(q, k, v, do, causal=causal, softmax_scale=scale, **options)
    floor = 8 * 2**-24 * max(t.abs().max().item() for t in exact)
    for name, error, allowed in zip(
        ("output", "dq", "dk", "dv"), errors(got, exact), baseline, strict=True
    ):
        assert error <= 2 * allowed + floor, (name, error, allowed)
    assert all(t.dtype == q.dtype for t in got)
    assert ledger.counts.sum() == 0, ledger.summary()


@pytest.mark.parametrize("seq, dim, dtype, causal, heads", list(_cases()))
def test_output_and_gradients_are_within_flash_attentions_rule(seq, dim, dtype, causal, heads):
    batch = 2 if seq < 64 else 1
    q, k, v, do = inputs(batch, *heads, seq, dim, dtype, seed=seq + dim)
    if DEVICE.type == "cuda" and dtype == torch.float32:  # refused there, by design
        with pytest.raises(ValueError, match="bfloat16 or float16"):
            run(q, k, v, do, causal=causal)
        return
    assert_within_the_rule(q, k, v, do, causal, 1 / math.sqrt(dim))


WIDE = torch.float32 if DEVICE.type == "cpu" else torch.bfloat16


def test_head_dims_between_the_kernels_widths_are_padded():
    q, k, v, do = inputs(1, 2, 1, 33, 80, WIDE)
    assert_within_the_rule(q, k, v, do, True, 80**-0.5)


def test_queries_and_keys_of_different_lengths_take_the_top_left_causal_mask():
    q, k, v, do = inputs(1, 2, 2, 20, 64, WIDE, kv_seq=70)
    for causal in (True, False):
        assert_within_the_rule(q, k, v, do, causal, 0.125)


def test_inputs_in_megatrons_layout_need_no_copy():
    """q, k, v as views of [seq, batch, heads, dim] tensors: the output and gradients come back
    in the same layout, so that the attention's [sq, b, np * hn] output is a view."""
    base = [torch.randn(40, 2, h, 64) for h in (4, 2, 2)]
    q, k, v = (t.permute(1, 2, 0, 3) for t in base)
    do = torch.randn(40, 2, 4, 64).permute(1, 2, 0, 3)
    (out, dq, dk, dv), _ = run(q, k, v, do)
    assert out.permute(2, 0, 1, 3).is_contiguous()
    assert dq.permute(2, 0, 1, 3).is_contiguous() and dk.permute(2, 0, 1, 3).is_contiguous()
    exact = outputs(lambda a, b, c: attention(a, b, c, True, 0.125), q, k, v, do, torch.float64)
    assert max(errors([out, dq, dk, dv], exact)) < 1e-5


def test_k_and_v_as_views_of_megatrons_fused_qkv_need_no_copy():
    """GQA as Megatron splits its fused QKV projection: v is a view of one
    [seq, batch, groups, (heads / groups + 2) * dim] tensor, q and k new tensors (RoPE's), so
    that k and v differ in strides."""
    seq, batch, groups, per_group, dim = 40, 2, 2, 2, 64
    mixed = torch.randn(seq, batch, groups, (per_group + 2) * dim)
    q, k, v = torch.split(mixed, [per_group * dim, dim, dim], dim=3)
    q = q.reshape(seq, batch, groups * per_group, dim).permute(1, 2, 0, 3)
    q, k, v = q * 1.0, k.permute(1, 2, 0, 3) * 1.0, v.permute(1, 2, 0, 3)
    assert k.stride() != v.stride() and v.storage_offset() > 0
    do = torch.randn_like(q)
    (out, dq, dk, dv), ledger = run(q, k, v, do)
    exact = outputs(lambda a, b, c: attention(a, b, c, True, 0.125), q, k, v, do, torch.float64)
    assert max(errors([out, dq, dk, dv], exact)) < 1e-5
    assert ledger.counts.sum() == 0, ledger.summary()


def test_gpus_without_tma_load_through_pointers_to_the_same_numbers(monkeypatch):
    """GPUs before Hopper (A100) have no TMA: there the kernels load and store through masked
    pointers. In the interpreter both ways give the same numbers, bit for bit (a ragged length
    and a padded head dim included), and correct a fault alike."""
    q, k, v, do = inputs(1, 2, 1, 70, 80, torch.bfloat16)
    by_tma, _ = run(q, k, v, do)
    monkeypatch.setattr(launch, "tma", lambda device: False)
    by_pointers, ledger = run(q, k, v, do)
    assert all(torch.equal(a, b) for a, b in zip(by_tma, by_pointers, strict=True))
    assert ledger.counts.sum() == 0
    fault = FlashFault("grad_k", TensorFault("nan", position=(65, 3), batch_index=1))
    corrected, ledger = run(q, k, v, do, faults=[fault])
    assert all(torch.equal(a, b) for a, b in zip(by_tma, corrected, strict=True))
    assert ledger.summary()["grad_k"]["corrected"]["nan"] == 1


def test_the_checks_compiled_out_give_the_same_numbers():
    q, k, v, do = inputs(1, 2, 1, 70, 64, torch.bfloat16)
    checked, _ = run(q, k, v, do)
    plain, ledger = run(q, k, v, do, sections=())
    assert all(torch.equal(a, b) for a, b in zip(checked, plain, strict=True))
    assert ledger.counts.sum() == 0


@pytest.mark.parametrize(
    "args, message",
    [
        ((torch.randn(2, 4, 8), torch.randn(2, 4, 8), torch.randn(2, 4, 8)), "4-d"),
        (
            (torch.randn(1, 2, 8, 64), torch.randn(1, 2, 8, 64).half(), torch.randn(1, 2, 8, 64)),
            "one dtype",
        ),
        (
            (torch.randn(1, 2, 8, 64).double(),) * 3,
            "float32, bfloat16, float16",
        ),
        ((torch.randn(1, 3, 8, 64), torch.randn(1, 2, 8, 64), torch.randn(1, 2, 8, 64)), "split"),
        ((torch.randn(1, 2, 8, 64), torch.randn(1, 2, 8, 32), torch.randn(1, 2, 8, 32)), "head"),
        ((torch.randn(1, 2, 8, 64), torch.randn(1, 2, 9, 64), torch.randn(1, 2, 8, 64)), "differ"),
        ((torch.randn(1, 2, 8, 256),) * 3, "unfused"),
        ((torch.randn(1, 2, 0, 64),) * 3, "empty"),
    ],
)
def test_bad_inputs_are_refused_with_what_is_wrong(args, message):
    with pytest.raises(ValueError, match=message):
        flash_attention(*args)


def test_bad_options_are_refused():
    q = torch.randn(1, 2, 8, 64)
    with pytest.raises(ValueError, match="unknown section 'qkv'"):
        flash_attention(q, q, q, sections=("qkv",))
    with pytest.raises(ValueError, match="threshold_scale"):
        flash_attention(q, q, q, threshold_scale=0.0)
