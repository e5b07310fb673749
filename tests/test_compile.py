"""torch.compile with its default backend (inductor) runs a protected GPT on the CPU: the loss and
gradients of eager mode, and an injected fault still corrected. The checksum ops trace: their
fakes (or, for the composite encode ops, their decomposition) give the real outputs' layouts,
with static and with dynamic shapes (tests/ops/test_opcheck.py). Traced, a check takes the
GPU's sync-free path on the CPU too: it reads nothing on the host, so it does not break the
graph. Nor does the step, which the runtime reads in its hooks as Megatron-LM's train() sets it:
what a graph is specialised on is whether each section is due, so that a compiled model stops
compiling once it has seen each of its due patterns."""

import torch
from mcore import Shape, batch, build_gpt, spawn

SHAPE = Shape(layers=2)


def _compile_worker():
    from types import SimpleNamespace

    from megatron.training.global_vars import set_args
    from torch._dynamo.utils import counters

    from megatron_abft import Fault, inject, stats
    from megatron_abft.config import ABFTConfig
    from megatron_abft.spec import get_gpt_layer_abft_spec

    config = ABFTConfig(check_interval={"proj": 2})  # proj due on even steps, the rest on every one
    model = build_gpt(SHAPE, get_gpt_layer_abft_spec(config))
    tokens, positions, mask, labels = batch(SHAPE, 0)
    megatron_lm = SimpleNamespace(curr_iteration=None)  # Megatron-LM's arguments
    set_args(megatron_lm)

    def step(run, at):
        megatron_lm.curr_iteration = at - 1  # as train() sets it; the runtime's hook reads it
        model.zero_grad(set_to_none=True)
        loss = run(tokens, positions, mask, labels=labels).float().mean()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    def graphs_made(run, at):
        before = counters["stats"]["unique_graphs"]
        step(run, at)
        return counters["stats"]["unique_graphs"] - before

    eager = step(model, 2)
    compiled_model = torch.compile(model)  # inductor; the two layers' GEMMs differ in shape
    first = graphs_made(compiled_model, 3)  # proj not due
    compiled = step(compiled_model, 4)  # every section due, as in the eager step
    later = [graphs_made(compiled_model, at) for at in (5, 6)]
    counted = stats(model)["scores"]["detected"]
    nan = Fault("scores", "nan", "0d", layer=2, tp_rank=0, position=(5, 3), batch_index=1)
    with inject(model, [nan]) as landed:
        faulty = step(compiled_model, 7)
    scores = stats(model)["scores"]
    megatron_lm.curr_iteration = 7  # step 8: every section due
    explained = torch._dynamo.explain(model)(tokens, positions, mask, labels=labels)
    set_args(None)
    return {
        "breaks_in_checks": [
            str(b.reason).splitlines()[0]
            for b in explained.break_reasons
            if any(_in_checks(frame.filename) for frame in b.user_stack)
        ],
        "graphs": (first, later),
        "eager": eager,
        "compiled": compiled,
        "faulty": faulty,
        "clean_detected": sum(counted.values()),
        "landed": len(landed),
        "detected": sum(scores["detected"].values()),
        "corrected": sum(scores["corrected"].values()),
    }


def _in_checks(filename: str) -> bool:
    """Whether a frame is the checks' code: the guards, the check, the ops' wrappers."""
    return any(part in filename for part in CHECKS)


CHECKS = ("megatron_abft/check/", "megatron_abft/ops/", "megatron_abft/runtime/guard.py")


def _close(result, reference) -> bool:
    """The same loss, and gradients equal up to fp32 rounding of sums in another order (each
    tensor's, relative to its largest element)."""
    (loss, grads), (ref_loss, ref_grads) = result, reference
    return bool(torch.allclose(loss, ref_loss, rtol=1e-6)) and all(
        torch.allclose(grads[k], ref, rtol=1e-5, atol=1e-6 * float(ref.abs().max()))
        for k, ref in ref_grads.items()
    )


def test_inductor_compiles_a_protected_gpt_that_still_corrects_faults():
    """Compiled, the model gives eager's loss and gradients (up to inductor's fused rounding)
    and finds nothing on clean data; once it has run a step with proj due and one without, later
    steps compile nothing; a NaN landed in layer 2's scores under the compiled model
    is detected and corrected, and the step equals the clean one. No graph break lies inside
    the checks (the runtime's hooks and Megatron's own code still break the graph)."""
    [r] = spawn(1, 1, _compile_worker)
    assert r["breaks_in_checks"] == []  # traced, the checks decide on the device
    first, later = r["graphs"]
    assert first > 0 and later == [0, 0]  # each due pattern compiled once, not each step
    assert _close(r["compiled"], r["eager"])
    assert r["clean_detected"] == 0
    assert r["landed"] == 1 and r["detected"] == r["corrected"] == 1
    assert _close(r["faulty"], r["eager"])
    assert torch.isfinite(r["faulty"][0])
