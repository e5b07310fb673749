"""The protected projections with ``ABFTConfig.checked_gemm``: the checked GEMM (Triton's
interpreter on these CPU ranks) computes every due QKV and output projection inside Megatron's
own autograd function, so that losses and gradients equal Megatron's GEMM's to the GEMM's
rounding, clean tiles tally nothing, and what the kernel reports reaches the guard's ledger and
the policy; a projection with a fault to land takes Megatron's GEMM and the usual check.

Spawns gloo ranks on CPU (tests/mcore.py); each test says how many."""

import pytest
import torch
from mcore import Shape, build_gpt, loss_and_grads, spawn

from megatron_abft.config import ABFTConfig

CASES = {
    1: [Shape(), Shape(groups=2, dtype=torch.bfloat16), Shape(recompute="full")],
    2: [Shape(groups=2), Shape(sequence_parallel=True)],
}


def _spy(calls: list):
    """Count the checked GEMM's calls (and keep their worst code) on this rank."""
    from megatron_abft.ops import checked_gemm

    real = checked_gemm.checked_linear

    def counted(*args, **kwargs):
        y, codes = real(*args, **kwargs)
        calls.append(int(codes.max()))
        return y, codes

    checked_gemm.checked_linear = counted


def _equality_worker(shapes):
    from megatron.core import tensor_parallel

    from megatron_abft import stats
    from megatron_abft.spec import get_gpt_layer_abft_spec

    calls: list = []
    _spy(calls)
    results = []
    for shape in shapes:
        runs = {}
        # against the protected layers without it, which equal Megatron's bit for bit
        # (tests/test_spec.py) and, unlike its local spec's torch norm, take sequence parallelism
        specs = {
            "stock": get_gpt_layer_abft_spec(ABFTConfig(fused_softmax=False)),
            "checked": get_gpt_layer_abft_spec(ABFTConfig(fused_softmax=False, checked_gemm=True)),
        }
        for name, spec in specs.items():
            model = build_gpt(shape, spec)
            torch.manual_seed(7)
            tensor_parallel.model_parallel_cuda_manual_seed(1234)
            runs[name] = [loss_and_grads(model, shape, step) for step in range(2)]
        runs["calls"], runs["stats"] = list(calls), stats(model)
        calls.clear()
        results.append(runs)
    return results


@pytest.mark.parametrize("tp", sorted(CASES))
def test_the_checked_gemm_computes_the_projections_as_megatron_does(tp):
    """Spawns ``tp`` ranks."""
    ranks = spawn(tp, tp, _equality_worker, CASES[tp])
    for rank, result in enumerate(ranks):
        if isinstance(result, Exception):
            raise AssertionError(f"rank {rank} failed") from result
    for result in ranks:
        for shape, runs in zip(CASES[tp], result, strict=True):
            # two projections a layer, two steps (each forward twice under full recompute),
            # every tile clean
            passes = 2 if shape.recompute == "full" else 1
            assert runs["calls"] == [0] * (2 * shape.layers * 2 * passes), shape
            counts = runs["stats"]
            assert all(n == 0 for s in counts.values() for o in s.values() for n in o.values())
            half = shape.dtype != torch.float32
            for (loss, grads), (ref_loss, ref_grads) in zip(
                runs["checked"], runs["stock"], strict=True
            ):
                torch.testing.assert_close(loss, ref_loss, rtol=1e-2 if half else 1e-6, atol=0)
                for key, ref in ref_grads.items():
                    error = (grads[key].double() - ref.double()).norm() / ref.double().norm()
                    assert error <= (2e-2 if half else 1e-5), (shape, key, float(error))


def _ledger_worker():
    from megatron_abft import inject, stats
    from megatron_abft.faults import Fault
    from megatron_abft.ops import checked_gemm
    from megatron_abft.runtime.guard import iter_guards
    from megatron_abft.spec import get_gpt_layer_abft_spec

    shape = Shape()
    config = ABFTConfig(fused_softmax=False, checked_gemm=True, on_uncorrectable="log")
    model = build_gpt(shape, get_gpt_layer_abft_spec(config))
    out = {}
    real = checked_gemm.checked_linear
    for persistent in (False, True):  # a fault inside the kernel of layer 1's qkv projection
        armed = [True]

        def faulty(*args, persistent=persistent, armed=armed, **kwargs):
            if armed.pop() if armed else False:
                kwargs["fault"] = (5, 7, float("nan"), persistent)
            return real(*args, **kwargs)

        checked_gemm.checked_linear = faulty
        loss_and_grads(model, shape)
        pending = [
            (g.layer, g.section) for g in iter_guards(model) if g.pending is not None and g.pending
        ]
        out[persistent] = (stats(model), pending)
        for guard in iter_guards(model):
            guard.pending = None
            guard.reset()
    checked_gemm.checked_linear = real
    calls: list = []
    _spy(calls)
    with inject(model, [Fault("qkv", "inf", "0d", layer=2, seed=1)]) as landed:
        loss_and_grads(model, shape)
    out["injected"] = (len(landed), stats(model), len(calls))
    return out


def test_what_the_kernel_finds_reaches_the_ledger_and_a_fault_to_land_takes_megatrons_gemm():
    """Spawns 1 rank."""
    (result,) = spawn(1, 1, _ledger_worker)
    if isinstance(result, Exception):
        raise AssertionError("the rank failed") from result
    corrected, pending = result[False]
    assert corrected["qkv"]["corrected"]["nan"] == 1
    assert sum(corrected["qkv"]["uncorrectable"].values()) == 0 and pending == []
    # a persistent NaN is uncorrectable where it begins, and later checks see it in their inputs
    uncorrectable, pending = result[True]
    assert uncorrectable["qkv"]["uncorrectable"]["nan"] >= 1 and (1, "qkv") in pending
    landed, injected, calls = result["injected"]
    # layer 2's qkv took Megatron's GEMM and the usual check, which corrected the INF; the
    # other three projections took the checked GEMM
    assert landed == 1 and injected["qkv"]["corrected"]["inf"] == 1 and calls == 3


def test_where_the_checked_gemm_serves_and_a_dtype_it_does_not_take_is_said_once(caplog):
    from types import SimpleNamespace

    from megatron_abft.layers.linear import _CheckedLocalGemm

    layer = _CheckedLocalGemm()
    layer.abft_config = ABFTConfig(checked_gemm=True)
    layer.abft_guard = SimpleNamespace(section="qkv")

    def tensors(device, dtype, trainable=True):
        where = torch.device(device)
        return (
            SimpleNamespace(device=where, dtype=dtype),
            SimpleNamespace(device=where, dtype=dtype, requires_grad=trainable),
        )

    assert layer._checked_gemm_serves(*tensors("cuda", torch.bfloat16), (), {})
    assert layer._checked_gemm_serves(*tensors("cpu", torch.float32), (), {})
    assert not layer._checked_gemm_serves(*tensors("cpu", torch.float32, False), (), {})
    sharded = {"gtp_remat_size": 2}
    assert not layer._checked_gemm_serves(*tensors("cuda", torch.float16), (), sharded)
    assert not layer._checked_gemm_serves(*tensors("cpu", torch.float32), (1,), {})
    for _ in range(2):
        assert not layer._checked_gemm_serves(*tensors("cuda", torch.float32), (), {})
    said = [r.getMessage() for r in caplog.records if r.name == "megatron_abft.layers.linear"]
    assert len(said) == 1 and "bf16 and fp16 on GPUs" in said[0] and "qkv" in said[0]
    layer.abft_config = ABFTConfig()
    assert not layer._checked_gemm_serves(*tensors("cuda", torch.bfloat16), (), {})
