"""The ABFT layer spec: what it builds, what it refuses, and that clean runs equal Megatron's.

Distributed tests spawn gloo ranks on CPU (tests/mcore.py); each says how many."""

import dataclasses

import pytest
import torch
from mcore import Shape, build_gpt, loss_and_grads, spawn

from megatron_abft.config import ABFTConfig

EQUALITY_CASES = {
    1: [Shape(), Shape(groups=2, dtype=torch.bfloat16), Shape(dtype=torch.float16, padding=True)],
    2: [
        Shape(),
        Shape(groups=2),
        Shape(groups=1),  # MQA: fewer KV groups than ranks
        Shape(dtype=torch.bfloat16),
        Shape(groups=2, dtype=torch.bfloat16, padding=True),
        Shape(dropout=0.1),
        Shape(recompute="selective", dropout=0.1),
        Shape(recompute="full"),
    ],
    4: [Shape(heads=8, groups=2), Shape(heads=8, groups=2, dtype=torch.bfloat16)],
}


def _equality_worker(shapes):
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_abft.spec import get_gpt_layer_abft_spec

    specs = {
        "stock": get_gpt_layer_local_spec(),
        "abft": get_gpt_layer_abft_spec(ABFTConfig(fused_softmax=False)),
        "disabled": get_gpt_layer_abft_spec(ABFTConfig(enabled=False)),
        "fused": get_gpt_layer_abft_spec(ABFTConfig()),
    }
    results = []
    for shape in shapes:
        runs = {}
        for name, spec in specs.items():
            model = build_gpt(shape, spec)
            torch.manual_seed(7)
            tensor_parallel.model_parallel_cuda_manual_seed(1234)  # the same dropout streams
            runs[name] = [loss_and_grads(model, shape, step) for step in range(2)]
        results.append(runs)
    return results


@pytest.mark.parametrize("tp", sorted(EQUALITY_CASES))
def test_clean_protected_runs_are_bitwise_equal_to_megatron(tp):
    """Spawns ``tp`` ranks. Protected (with Megatron's softmax) and disabled-protection models
    give exactly the stock model's losses and TP-gathered gradients, for every case of
    EQUALITY_CASES[tp]; with the fused softmax, the same to its rounding."""
    ranks = spawn(tp, tp, _equality_worker, EQUALITY_CASES[tp])
    for rank, result in enumerate(ranks):
        if isinstance(result, Exception):
            raise AssertionError(f"rank {rank} failed") from result
    for shape, runs in zip(EQUALITY_CASES[tp], ranks[0], strict=True):
        for name in ("abft", "disabled", "fused"):
            for step, ((loss, grads), (ref_loss, ref_grads)) in enumerate(
                zip(runs[name], runs["stock"], strict=True)
            ):
                if name != "fused":
                    assert torch.equal(loss, ref_loss), (shape, name, step)
                    for key in ref_grads:
                        assert torch.equal(grads[key], ref_grads[key]), (shape, name, step, key)
                    continue
                assert_fused_close(loss, ref_loss, grads, ref_grads, shape.dtype)


def assert_fused_close(loss, ref_loss, grads, ref_grads, dtype):
    """The fused softmax's P differs from torch's by a few units in the last place; in fp16 and
    bf16 its backward reads P as stored, where Megatron's torch path keeps P in fp32 (its fused
    CUDA kernels do as ours), so gradients differ by the dtype's rounding."""
    half = dtype in (torch.bfloat16, torch.float16)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-3 if half else 1e-6, atol=0)
    for key, ref in ref_grads.items():
        error = (grads[key].double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)
        assert error <= (2e-2 if half else 2e-6), (key, float(error))


def _construction_worker():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnBackend

    from megatron_abft.layers.attention import ProtectedDotProductAttention
    from megatron_abft.layers.linear import (
        ProtectedColumnParallelLinear,
        ProtectedRowParallelLinear,
    )
    from megatron_abft.spec import apply_abft, get_gpt_layer_abft_spec

    config = ABFTConfig(sections="scores,context", block_size=64)
    model = build_gpt(Shape(), get_gpt_layer_abft_spec(config))
    attention = model.decoder.layers[0].self_attention
    built = {
        "qkv": type(attention.linear_qkv),
        "core": type(attention.core_attention),
        "proj": type(attention.linear_proj),
        "same_config": attention.core_attention.abft_config is config
        and attention.linear_qkv.abft_config is config,
    }
    errors = {}
    flash = dataclasses.replace(model.config, attention_backend=AttnBackend.flash)
    try:
        ProtectedDotProductAttention(flash, 1, attention.core_attention.attn_mask_type, "self")
    except ValueError as error:
        errors["flash"] = str(error)
    q = torch.zeros(4, 1, 4, 16)
    try:
        attention.core_attention(q, q, q, None, packed_seq_params=PackedSeqParams())
    except NotImplementedError as error:
        errors["packed"] = str(error)
    other = ABFTConfig(on_uncorrectable="raise")
    again = apply_abft(apply_abft(get_gpt_layer_local_spec()), other)  # re-configures
    entries = again.submodules.self_attention.submodules
    built["reapplied"] = all(
        getattr(entries, name).params["abft_config"] is other
        for name in ("linear_qkv", "core_attention", "linear_proj")
    )
    foreign = get_gpt_layer_local_spec()
    foreign.submodules.self_attention.submodules.linear_qkv = torch.nn.Linear  # e.g. TE's
    try:
        apply_abft(foreign)
    except ValueError as error:
        errors["foreign"] = str(error)
    built["types"] = (
        ProtectedColumnParallelLinear,
        ProtectedDotProductAttention,
        ProtectedRowParallelLinear,
    )
    return built, errors


def test_the_spec_builds_protected_modules_and_refuses_what_it_cannot_protect():
    """Spawns 1 rank."""
    [result] = spawn(1, 1, _construction_worker)
    if isinstance(result, Exception):
        raise result
    built, errors = result
    assert (built["qkv"], built["core"], built["proj"]) == built["types"]
    assert built["same_config"]
    assert "attention_backend=flash is not supported" in errors["flash"]
    assert "use attention_backend=local" in errors["flash"]
    assert "packed sequences" in errors["packed"]
    assert built["reapplied"]
    assert "not Megatron-core's ColumnParallelLinear" in errors["foreign"]
    assert "Transformer Engine" in errors["foreign"]


def test_multi_latent_attention_is_refused():
    from megatron_abft.spec import get_gpt_layer_abft_spec

    with pytest.raises(ValueError, match="multi-latent attention"):
        get_gpt_layer_abft_spec(multi_latent_attention=True)


def test_a_bad_config_object_is_refused():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_abft.spec import apply_abft

    with pytest.raises(TypeError, match="abft_config must be an ABFTConfig"):
        apply_abft(get_gpt_layer_local_spec(), {"enabled": True})


def test_context_parallelism_is_refused_with_what_to_use():
    from types import SimpleNamespace

    from megatron.core.transformer.enums import AttnBackend

    from megatron_abft.layers.attention import reject_unsupported

    config = SimpleNamespace(context_parallel_size=2, attention_backend=AttnBackend.auto)
    with pytest.raises(ValueError, match="use context_parallel_size=1"):
        reject_unsupported(config, "here")


def test_fp8_is_refused_with_what_to_use():
    from types import SimpleNamespace

    from megatron.core.transformer.enums import AttnBackend

    from megatron_abft.layers.attention import reject_unsupported

    config = SimpleNamespace(
        context_parallel_size=1, attention_backend=AttnBackend.local, fp8="hybrid"
    )
    with pytest.raises(ValueError, match="FP8 \\(fp8=hybrid\\) is not supported.*use fp8=None"):
        reject_unsupported(config, "here")


@pytest.mark.parametrize("graphs", ["local", "transformer_engine", "full_iteration"])
def test_cuda_graphs_are_refused_with_what_to_use(graphs):
    """Megatron's CUDA graphs would replay the captured step's host decisions (what is due, the
    policy's view of an uncorrectable fault): refused, not silently wrong."""
    from types import SimpleNamespace

    from megatron.core.transformer.enums import AttnBackend

    from megatron_abft.layers.attention import reject_unsupported

    config = SimpleNamespace(
        context_parallel_size=1, attention_backend=AttnBackend.local, cuda_graph_impl=graphs
    )
    with pytest.raises(ValueError, match=f"cuda_graph_impl={graphs}.*use cuda_graph_impl=none"):
        reject_unsupported(config, "here")
    config.cuda_graph_impl = "none"
    reject_unsupported(config, "here")  # accepted


def _scores_gemm_worker():
    from unittest import mock

    from megatron_abft.spec import get_gpt_layer_abft_spec

    configs = {
        "idle": ABFTConfig(sections=()),
        "all": ABFTConfig(),
        "scores": ABFTConfig(sections="scores"),
        "context": ABFTConfig(sections="context"),
        "unfused": ABFTConfig(fused_softmax=False),
    }
    real, counts = torch.baddbmm, {}
    for name, config in configs.items():
        model = build_gpt(Shape(), get_gpt_layer_abft_spec(config))
        calls = []

        def counted(*args, calls=calls, **kwargs):
            calls.append(1)
            return real(*args, **kwargs)

        with mock.patch.object(torch, "baddbmm", counted):
            loss_and_grads(model, Shape())
        counts[name] = len(calls)
    return counts


def test_the_scores_gemm_runs_once_a_layer_whatever_is_checked():
    """Spawns 1 rank. A clean forward computes S = Q K^T once per layer, fused or not, whichever
    sections are due."""
    (counts,) = spawn(1, 1, _scores_gemm_worker)
    if isinstance(counts, Exception):
        raise counts
    assert counts == dict.fromkeys(("idle", "all", "scores", "context", "unfused"), Shape().layers)
