"""ProtectedFlashAttention in Megatron-core: what the spec builds, what it refuses, and a GPT
(GQA, RoPE, causal) under tensor parallelism that matches the stock local spec, clean and with
faults in every section on either rank. Distributed tests spawn gloo ranks on CPU
(tests/mcore.py), the kernels in Triton's interpreter; each test says how many ranks."""

import dataclasses
import io
import logging

import pytest
import torch
from dispatched import Dispatched
from flash_cases import CALLS
from mcore import Shape, build_gpt, loss_and_grads, spawn

from megatron_abft.config import FLASH_SECTIONS, ABFTConfig

GQA = Shape(heads=4, groups=2, seq=40)
MATCH = [GQA, Shape(heads=4, groups=1, seq=24), Shape(seq=24, dtype=torch.bfloat16)]


def _close(loss, ref_loss, grads, ref_grads, dtype):
    """Flash and Megatron's unfused attention round differently: equal to the dtype's rounding
    (bf16: P~ rounded for the P V GEMM, as every flash attention does)."""
    half = dtype != torch.float32
    torch.testing.assert_close(loss, ref_loss, rtol=1e-2 if half else 1e-5, atol=0)
    for key, ref in ref_grads.items():
        error = (grads[key].double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)
        assert error <= (3e-2 if half else 1e-4), (key, float(error))


def _matching_worker(shapes):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_abft.spec import get_gpt_layer_abft_spec

    flash = get_gpt_layer_abft_spec(ABFTConfig(), attention="flash")
    stock = get_gpt_layer_local_spec()
    return [
        (loss_and_grads(build_gpt(s, flash), s), loss_and_grads(build_gpt(s, stock), s))
        for s in shapes
    ]


def _faults_worker(shape):
    """Run i lands NaNs in layer 2's kernels in the sections of call i (CALLS: a forward
    section with a backward one, or a backward one alone) on rank 0 and of call i + 1 on rank 1,
    so that every section is hit on either rank; the run's loss and gradients, and what this
    rank's counters and events say."""
    from megatron_abft import Fault, collect_events, inject, reset_stats, stats
    from megatron_abft.spec import get_gpt_layer_abft_spec

    model = build_gpt(shape, get_gpt_layer_abft_spec(ABFTConfig(), attention="flash"))
    clean = loss_and_grads(model, shape)
    results = []
    for i, calls in enumerate(CALLS):
        reset_stats(model)
        sections = (calls, CALLS[(i + 1) % len(CALLS)])
        faults = [
            Fault(s, "nan", layer=2, tp_rank=rank, position=(20, 3), seed=1)
            for rank, call in enumerate(sections)
            for s in call
        ]
        with inject(model, faults) as log:
            run = loss_and_grads(model, shape)
        results.append(
            (
                sections,
                run,
                stats(model),
                [(e["rank"], e["layer"], e["section"], e["action"]) for e in collect_events(model)],
                len(log),
            )
        )
    return clean, results


@pytest.mark.parametrize("tp", [2])
def test_the_flash_spec_matches_the_stock_spec(tp):
    """Spawns 2 ranks: GQA (2 KV groups), MQA (1 group, fewer than ranks) and bf16."""
    ranks = spawn(tp, tp, _matching_worker, MATCH)
    for rank in ranks:
        if isinstance(rank, Exception):
            raise rank
    for shape, (flash, stock) in zip(MATCH, ranks[0], strict=True):
        _close(flash[0], stock[0], flash[1], stock[1], shape.dtype)


def test_faults_in_every_section_on_either_rank_are_corrected_and_named():
    """Spawns 2 ranks. Each transient fault leaves loss and gradients as the clean run's, bit
    for bit, and only its rank counts it, in its section, where the events name it."""
    ranks = spawn(2, 2, _faults_worker, GQA)
    for rank in ranks:
        if isinstance(rank, Exception):
            raise rank
    hit = set()
    for here, (clean, results) in enumerate(ranks):
        for sections, (loss, grads), counts, events, landed in results:
            assert torch.equal(loss, clean[0]), sections
            assert all(torch.equal(grads[k], clean[1][k]) for k in grads), sections
            mine = sections[here]
            assert landed == len(mine)
            assert events == [(here, 2, section, "corrected") for section in mine]
            for name, outcomes in counts.items():
                found = {o: sum(kinds.values()) for o, kinds in outcomes.items()}
                want = (1, 1) if name in mine else (0, 0)
                assert (found["detected"], found["corrected"]) == want, (here, name, mine)
                assert found["uncorrectable"] == 0
            hit.update((section, here) for section in mine)
    assert len(hit) == 2 * len(FLASH_SECTIONS)


def _persistent_worker(policies):
    """For each policy: a persistent fault in rank 1's kernels, and what finish_step decides
    on this rank (the error's ``where`` under raise), then after a clean step."""
    from megatron_abft import ABFTUncorrectableError, Fault, finish_step, inject, set_step
    from megatron_abft.spec import get_gpt_layer_abft_spec

    shape = Shape(seq=24)
    decisions = {}
    for policy in policies:
        config = ABFTConfig(on_uncorrectable=policy)
        model = build_gpt(shape, get_gpt_layer_abft_spec(config, attention="flash"))
        set_step(model, 0)
        fault = Fault("grad_k", "inf", layer=1, tp_rank=1, persistent=True, position=(5, 2))
        with inject(model, [fault]):
            loss_and_grads(model, shape)
        try:
            decisions[policy] = finish_step(model).action
        except ABFTUncorrectableError as error:
            decisions[policy] = error.where
        set_step(model, 1)  # a clean step: the fault, seen once, is not handed on again
        loss_and_grads(model, shape)
        with Dispatched() as made:
            decisions[policy, "next"] = finish_step(model).action
        decisions[policy, "ops"] = made.ops
        with Dispatched() as made:  # the loop's next call, with no pass since finish_step
            set_step(model, 2)
        decisions[policy, "settled"] = made.ops
    return decisions


def test_a_persistent_fault_reaches_the_policy_on_every_rank():
    """Spawns 2 ranks; the fault is in rank 1's kernels, the decision is every rank's."""
    ranks = spawn(2, 2, _persistent_worker, ("raise", "recompute", "skip_step"))
    where = {"rank": 1, "tp_rank": 1, "layer": 1, "section": "grad_k", "step": 0}
    assert ranks[1]["raise"] == [where] and ranks[0]["raise"][0]["rank"] == "another"
    for rank in ranks:
        assert (rank["recompute"], rank["skip_step"]) == ("recompute", "skip_step")
        assert all(rank[policy, "next"] == "none" for policy in ("raise", "recompute", "skip_step"))
        # one read of every guard's counts, however many layers (a flash layer's seven guards
        # took eight ops each)
        assert len(rank["raise", "ops"]) <= 6, rank["raise", "ops"]
        # and none of them again where no layer has run since: set_step only moves the clocks
        clocks = {"aten._foreach_zero_.default", "aten._foreach_add_.Scalar"}
        assert set(rank["raise", "settled"]) == clocks, rank["raise", "settled"]


def _construction_worker():
    from megatron.core.transformer.enums import AttnBackend

    from megatron_abft import spec as spec_module
    from megatron_abft.layers.attention import ProtectedDotProductAttention
    from megatron_abft.layers.flash_attention import ProtectedFlashAttention
    from megatron_abft.spec import get_gpt_layer_abft_spec

    def core(attention):
        model = build_gpt(Shape(), get_gpt_layer_abft_spec(ABFTConfig(), attention=attention))
        return type(model.decoder.layers[0].self_attention.core_attention)

    built = {name: core(name) for name in ("flash", "unfused", "auto")}
    said = io.StringIO()
    logger = logging.getLogger("megatron_abft.spec")
    logger.setLevel(logging.INFO)
    logger.addHandler(logging.StreamHandler(said))
    spec_module.kernels_compile_here = lambda: True  # as on a GPU: auto weighs the config
    for dropout in (0.1, 0.0, 0.1):
        model = build_gpt(Shape(dropout=dropout), get_gpt_layer_abft_spec(ABFTConfig()))
        layers = model.decoder.layers
        built[f"auto, GPU, dropout {dropout}"] = {
            type(layer.self_attention.core_attention) for layer in layers
        }
    errors = {"said": said.getvalue()}
    spec = get_gpt_layer_abft_spec(ABFTConfig(), attention="flash")
    for name, shape in {"dropout": Shape(dropout=0.1)}.items():
        try:
            build_gpt(shape, spec)
        except ValueError as error:
            errors[name] = str(error)
    model = build_gpt(Shape(), spec)
    attention = model.decoder.layers[0].self_attention.core_attention
    for name, backend in {"fused": AttnBackend.fused, "flash": AttnBackend.flash}.items():
        config = dataclasses.replace(model.config, attention_backend=backend)
        try:
            ProtectedFlashAttention(config, 1, attention.attn_mask_type, "self")
            errors[name] = None
        except ValueError as error:
            errors[name] = str(error)
    try:
        from megatron.core.transformer.enums import AttnMaskType

        ProtectedFlashAttention(model.config, 1, AttnMaskType.padding, "self")
    except ValueError as error:
        errors["padding"] = str(error)
    return built == {
        "flash": ProtectedFlashAttention,
        "unfused": ProtectedDotProductAttention,
        "auto": ProtectedDotProductAttention,  # no GPU here
        "auto, GPU, dropout 0.1": {ProtectedDotProductAttention},
        "auto, GPU, dropout 0.0": {ProtectedFlashAttention},
    }, errors


def test_the_spec_builds_the_attention_asked_for_and_refuses_what_flash_lacks():
    """Spawns 1 rank."""
    (built, errors) = spawn(1, 1, _construction_worker)[0]
    assert built
    assert "attention_dropout=0" in errors["dropout"] and "attention='unfused'" in errors["dropout"]
    assert errors["flash"] is None  # Megatron's flash backend is this attention now
    assert "attention_backend=fused is not supported" in errors["fused"]
    assert "attention='unfused'" in errors["padding"]
    # auto says once what it chose for each reason, whatever the number of layers and builds
    assert errors["said"].splitlines() == [
        "[abft] attention=auto: ProtectedDotProductAttention, since attention dropout (0.1) is "
        "not supported by the flash kernels",
        "[abft] attention=auto: ProtectedFlashAttention, since the flash kernels compile for "
        "this GPU",
    ]


@pytest.mark.parametrize(
    "sections, interval, missing",
    [
        (None, 1, None),  # every section, every step: what ran clean on an H200
        (("scores", "context", "grad_q"), 1, None),
        (("grad_v",), 1, "bwd_scores, grad_probs, grad_k"),
        (None, {"grad_k": 2}, "grad_k"),  # grad_v alone of them on odd steps
        (None, {"grad_v": 4, "grad_k": 2}, None),  # grad_k due whenever grad_v is
    ],
)
def test_on_a_gpu_grad_v_is_checked_only_with_the_other_dkdv_sections(
    sections, interval, missing, monkeypatch
):
    """On a GPU flash_refusal (which the flash attention raises at construction, and auto
    takes as its reason for the unfused one) names a config that checks grad_v on a step
    without the rest of dK/dV's sections, whose kernel hit an illegal memory access on an H200;
    on the CPU, in the interpreter, such configs run."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_abft.layers.flash_attention import flash_refusal

    given = {} if sections is None else {"sections": sections}
    abft = ABFTConfig(check_interval=interval, **given)
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=2, bf16=True,
        params_dtype=torch.bfloat16, attention_dropout=0.0,
    )  # fmt: skip
    assert flash_refusal(config, AttnMaskType.causal, 0.0, abft) is None  # no GPU here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    refusal = flash_refusal(config, AttnMaskType.causal, 0.0, abft)
    if missing is None:
        assert refusal is None
    else:
        assert f"grad_v on a step without {missing} crashed" in refusal[0]
        assert "leave grad_v out, or use attention='unfused'" in refusal[1]
    assert flash_refusal(config, AttnMaskType.causal, 0.0, ABFTConfig(enabled=False)) is None


def test_an_unknown_attention_is_refused():
    from megatron_abft.spec import get_gpt_layer_abft_spec

    with pytest.raises(ValueError, match="attention='flashy': choose from auto, flash, unfused"):
        get_gpt_layer_abft_spec(ABFTConfig(), attention="flashy")


def _layer_scaling_worker():
    """Megatron's DotProductAttention and ProtectedFlashAttention, layer 3, with query-key
    layer scaling (the scale divided by the layer number, which the softmax multiplies back):
    the largest difference of their outputs on the same bf16 inputs."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_abft.layers.flash_attention import ProtectedFlashAttention

    config = TransformerConfig(
        num_layers=4, hidden_size=64, num_attention_heads=2, attention_dropout=0.0,
        bf16=True, params_dtype=torch.bfloat16, apply_query_key_layer_scaling=True,
        attention_softmax_in_fp32=True,
    )  # fmt: skip
    q, k, v = (torch.randn(24, 1, 2, 32).to(torch.bfloat16) for _ in range(3))
    outputs = [
        cls(config, 3, AttnMaskType.causal, "self")(q, k, v, None).float()
        for cls in (DotProductAttention, ProtectedFlashAttention)
    ]
    return (outputs[0] - outputs[1]).abs().max().item(), outputs[0].abs().max().item()


def test_query_key_layer_scaling_gives_megatrons_scale():
    """Spawns 1 rank."""
    difference, size = spawn(1, 1, _layer_scaling_worker)[0]
    assert difference < 0.02 * size  # bf16 rounding, where a wrong scale moves it by tens of %
