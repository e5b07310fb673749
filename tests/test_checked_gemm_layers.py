"""The protected layers with ``ABFTConfig.checked_gemm``: the checked GEMM (Triton's
interpreter on these CPU ranks) computes every due QKV and output projection inside Megatron's
own autograd function, and the unfused attention's scores and context, so that losses and
gradients equal Megatron's GEMMs' to their rounding, clean tiles tally nothing, and what the
kernel reports reaches the guard's ledger, the policy and the events (which name the sample and
head); a section with a fault to land takes Megatron's GEMM and the usual check.

Spawns gloo ranks on CPU (tests/mcore.py); each test says how many."""

import pytest
import torch
from dispatched import Dispatched
from mcore import Shape, build_gpt, loss_and_grads, spawn

from megatron_abft.config import ABFTConfig

CASES = {
    1: [
        Shape(),
        Shape(groups=2, dtype=torch.bfloat16),
        Shape(recompute="full"),
        Shape(padding=True, dropout=0.1),
    ],
    2: [Shape(groups=2), Shape(sequence_parallel=True)],
}


def _spy(calls: dict):
    """Count the checked GEMM's calls (and keep their worst code) on this rank, the projections'
    (``linear``) and the attention's (``matmul``) apart."""
    from megatron_abft.ops import checked_gemm

    for name in ("linear", "matmul"):
        real = getattr(checked_gemm, f"checked_{name}")
        calls[name] = []

        def counted(*args, real=real, name=name, **kwargs):
            y, codes = real(*args, **kwargs)
            calls[name].append(int(codes.max()) if codes.numel() else None)
            return y, codes

        setattr(checked_gemm, f"checked_{name}", counted)


def _equality_worker(shapes):
    from megatron.core import tensor_parallel

    from megatron_abft import stats
    from megatron_abft.spec import get_gpt_layer_abft_spec

    calls: dict = {}
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
            with Dispatched() as made:
                runs[name] = [loss_and_grads(model, shape, step) for step in range(2)]
            runs[name, "zeros"] = sum("zeros" in op for op in made.ops)
        runs["calls"], runs["stats"] = {k: list(v) for k, v in calls.items()}, stats(model)
        for made in calls.values():
            made.clear()
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
            # two projections and two attention GEMMs a layer, two steps (each forward twice
            # under full recompute), every tile clean
            passes = 2 if shape.recompute == "full" else 1
            for kind in ("linear", "matmul"):
                assert runs["calls"][kind] == [0] * (2 * shape.layers * 2 * passes), shape
            # the codes have no gradient, and no zeros are made for one
            assert runs["checked", "zeros"] <= runs["stock", "zeros"], shape
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
    from megatron_abft import collect_events, inject, stats
    from megatron_abft.faults import Fault
    from megatron_abft.ops import checked_gemm
    from megatron_abft.runtime.guard import iter_guards
    from megatron_abft.spec import get_gpt_layer_abft_spec

    shape = Shape()
    config = ABFTConfig(fused_softmax=False, checked_gemm=True, on_uncorrectable="log")
    model = build_gpt(shape, get_gpt_layer_abft_spec(config))
    out = {}
    # a NaN inside the kernel of layer 1's qkv projection (its first call) and of layer 1's
    # scores (the attention's first call; matrix 3: sample 0, head 3)
    targets = {"linear": (5, 7), "matmul": (3, 5, 7)}
    for name, where in targets.items():
        real = getattr(checked_gemm, f"checked_{name}")
        for persistent in (False, True):
            armed = [True]

            def faulty(*args, real=real, where=where, persistent=persistent, armed=armed, **kw):
                if armed.pop() if armed else False:
                    kw["fault"] = (*where, float("nan"), persistent)
                return real(*args, **kw)

            setattr(checked_gemm, f"checked_{name}", faulty)
            loss_and_grads(model, shape)
            pending = [
                (g.layer, g.section)
                for g in iter_guards(model)
                if g.pending is not None and g.pending
            ]
            out[name, persistent] = (stats(model), pending, collect_events(model))
            for guard in iter_guards(model):
                guard.pending = None
                guard.reset()
        setattr(checked_gemm, f"checked_{name}", real)
    calls: dict = {}
    _spy(calls)
    faults = [Fault("qkv", "inf", "0d", layer=2, seed=1), Fault("scores", "inf", "0d", layer=1)]
    with inject(model, faults) as landed:
        loss_and_grads(model, shape)
    out["injected"] = (len(landed), stats(model), calls)
    return out


def test_what_the_kernel_finds_reaches_the_ledger_and_a_fault_to_land_takes_megatrons_gemm():
    """Spawns 1 rank."""
    (result,) = spawn(1, 1, _ledger_worker)
    if isinstance(result, Exception):
        raise AssertionError("the rank failed") from result
    for name, section in (("linear", "qkv"), ("matmul", "scores")):
        corrected, pending, events = result[name, False]
        assert corrected[section]["corrected"]["nan"] == 1
        assert sum(corrected[section]["uncorrectable"].values()) == 0 and pending == []
        (event,) = [e for e in events if e["section"] == section]
        assert (event["layer"], event["kind"], event["action"]) == (1, "nan", "corrected")
        if section == "scores":  # the matrix named as sample and head, the tile by its origin
            assert (event["sample"], event["head"], event["row"], event["col"]) == (0, 3, 0, 0)
        # a persistent NaN is uncorrectable where it begins, and later checks see it in their
        # inputs
        uncorrectable, pending, _ = result[name, True]
        assert uncorrectable[section]["uncorrectable"]["nan"] >= 1 and (1, section) in pending
    landed, injected, calls = result["injected"]
    # layer 2's qkv and layer 1's attention took Megatron's GEMMs and the usual checks, which
    # corrected the INFs; the other three projections and layer 2's attention took the checked
    # GEMM
    assert landed == 2
    assert injected["qkv"]["corrected"]["inf"] == injected["scores"]["corrected"]["inf"] == 1
    assert (len(calls["linear"]), len(calls["matmul"])) == (3, 2)


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


def test_where_the_attentions_checked_gemm_serves_and_a_dtype_it_does_not_take_is_said_once(
    caplog,
):
    from types import SimpleNamespace

    from megatron_abft.layers.attention import ProtectedDotProductAttention

    layer = ProtectedDotProductAttention.__new__(ProtectedDotProductAttention)
    layer.abft_config = ABFTConfig(checked_gemm=True)

    def operands(device, *dtypes):
        return [SimpleNamespace(device=torch.device(device), dtype=d) for d in dtypes]

    assert layer._checked_gemm_serves(*operands("cuda", *[torch.bfloat16] * 3))
    assert layer._checked_gemm_serves(*operands("cpu", *[torch.float32] * 3))
    assert not layer._checked_gemm_serves(
        *operands("cpu", torch.float32, torch.float16, torch.float32)
    )
    for _ in range(2):
        assert not layer._checked_gemm_serves(*operands("cuda", *[torch.float32] * 3))
    said = [r.getMessage() for r in caplog.records if r.name == "megatron_abft.layers.attention"]
    assert len(said) == 1 and "bf16 and fp16 on GPUs" in said[0] and "attention" in said[0]
    layer.abft_config = ABFTConfig()
    assert not layer._checked_gemm_serves(*operands("cuda", *[torch.bfloat16] * 3))
