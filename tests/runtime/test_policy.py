"""Uncorrectable faults are never silent: each on_uncorrectable policy does what it says.

Every test spawns 2 gloo ranks (TP=2) and lands a fault beyond in-place correction in layer 1's
scores on tensor-parallel rank 1: INF in every element of one matrix, so that every row and
every column is wrong (recomputing the GEMM fixes it)."""

import pytest
import torch
from mcore import Shape, batch, build_gpt, loss_and_grads, spawn

from megatron_abft import Fault
from megatron_abft.config import ABFTConfig

SHAPE = Shape(heads=4, groups=2)


def whole_matrix_fault(step=None) -> Fault:
    block = (SHAPE.seq, SHAPE.seq)
    return Fault("scores", "inf", "2d", layer=1, tp_rank=1, step=step, block=block, seed=4)


def _model(policy):
    from megatron_abft.spec import get_gpt_layer_abft_spec

    return build_gpt(SHAPE, get_gpt_layer_abft_spec(ABFTConfig(on_uncorrectable=policy)))


def _close(result, reference) -> bool:
    (loss, grads), (ref_loss, ref_grads) = result, reference
    return bool(torch.allclose(loss, ref_loss, rtol=1e-6)) and all(
        torch.allclose(grads[k], ref_grads[k], rtol=1e-5, atol=1e-7) for k in ref_grads
    )


def _raise_worker():
    from megatron_abft import ABFTUncorrectableError, finish_step, inject, set_step

    model = _model("raise")
    set_step(model, 5)
    with inject(model, [whole_matrix_fault(step=5)]):
        loss_and_grads(model, SHAPE)
    try:
        finish_step(model)
    except ABFTUncorrectableError as error:
        return str(error)
    return None


def test_raise_names_rank_layer_section_and_step_and_stops_every_rank():
    """The uncorrected fault spreads (softmax turns the INF rows into NaN rows), so layer 2 is
    uncorrectable on both ranks too: every rank raises, naming its own faulty sections."""
    ranks = spawn(2, 2, _raise_worker)
    assert ranks[1].startswith("ABFT: uncorrectable fault at rank 1 layer 1 section scores step 5")
    assert ranks[0] is not None and "layer 1" not in ranks[0] and "layer 2" in ranks[0]


def _recompute_worker():
    from megatron_abft import collect_events, finish_step, inject, stats

    model = _model("recompute")
    reference = loss_and_grads(model, SHAPE)
    collect_events(model)
    with inject(model, [whole_matrix_fault()]) as landed:
        result = loss_and_grads(model, SHAPE)
    counts = stats(model)["scores"]
    return {
        "close": _close(result, reference),
        "action": finish_step(model).action,
        "uncorrectable": sum(counts["uncorrectable"].values()),
        "recomputed": counts["recomputed"]["gemm"],
        "events": collect_events(model),
        "landed": landed,
    }


def test_recompute_reruns_the_gemm_and_a_one_shot_fault_disappears():
    """On CPU the recompute costs no synchronisation, so the guard recomputes the GEMM itself."""
    ranks = spawn(2, 2, _recompute_worker)
    for rank in ranks:
        assert rank["close"] and rank["action"] == "none"
    assert ranks[1]["uncorrectable"] == 1 and ranks[1]["recomputed"] == 1
    assert ranks[0]["uncorrectable"] == 0 and ranks[0]["recomputed"] == 0
    [event], [landed] = ranks[1]["events"], ranks[1]["landed"]
    assert (event["section"], event["layer"], event["action"]) == ("scores", 1, "recomputed")
    heads = SHAPE.heads // 2  # per rank
    matrix = landed["injection"].batch_index  # flattened [sample, head]
    assert (event["sample"], event["head"]) == (matrix // heads, matrix % heads)
    assert landed["injection"].rows[0] <= event["row"] < landed["injection"].rows[1]
    assert ranks[0]["events"] == []


def _step_recompute_worker():
    import megatron_abft.runtime.guard as guard
    from megatron_abft import ABFTUncorrectableError, finish_step, inject

    guard.recompute_in_place_possible = lambda t: False  # behave as on a GPU: decide per step
    model = _model("recompute")
    reference = loss_and_grads(model, SHAPE)
    with inject(model, [whole_matrix_fault()]):
        loss_and_grads(model, SHAPE)
    first = finish_step(model).action
    retried = loss_and_grads(model, SHAPE)  # the step again: the one-shot fault is gone
    after_retry = finish_step(model, retried=True).action
    with inject(model, [whole_matrix_fault()]):  # a fault that comes back on the retry
        loss_and_grads(model, SHAPE)
    finish_step(model)
    with inject(model, [whole_matrix_fault()]):
        loss_and_grads(model, SHAPE)
    try:
        finish_step(model, retried=True)
        persistent = None
    except ABFTUncorrectableError as error:
        persistent = str(error)
    return {
        "first": first,
        "close": _close(retried, reference),
        "after_retry": after_retry,
        "persistent": persistent,
    }


def test_recompute_without_cheap_gemm_recompute_reruns_the_step_then_raises():
    ranks = spawn(2, 2, _step_recompute_worker)
    for rank in ranks:
        assert rank["first"] == "recompute" and rank["after_retry"] == "none" and rank["close"]
        assert rank["persistent"] is not None
    assert "rank 1 layer 1 section scores" in ranks[1]["persistent"]


def _skip_worker():
    from megatron_abft import finish_step, inject

    model = _model("skip_step")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    actions = []
    for faulty in (True, False):
        with inject(model, [whole_matrix_fault()] if faulty else []):
            loss_and_grads(model, SHAPE)
        outcome = finish_step(model)
        actions.append(outcome.action)
        if not outcome.skip:
            optimizer.step()
        same = all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
        if faulty:
            unchanged = same
    changed = not same
    return {"actions": actions, "unchanged_after_fault": unchanged, "changed_after_clean": changed}


def test_skip_step_discards_the_step_on_every_rank():
    for rank in spawn(2, 2, _skip_worker):
        assert rank["actions"] == ["skip_step", "none"]
        assert rank["unchanged_after_fault"] and rank["changed_after_clean"]


def _log_worker():
    from megatron_abft import finish_step, inject, stats

    model = _model("log")
    with inject(model, [whole_matrix_fault()]):
        loss_and_grads(model, SHAPE)
    outcome = finish_step(model)
    return {
        "action": outcome.action,
        "where": outcome.where,
        "uncorrectable": sum(stats(model)["scores"]["uncorrectable"].values()),
    }


def test_log_only_counts_and_reports_where():
    """Where the fault started (rank 1, layer 1, scores) and where its NaNs spread (layer 2,
    both ranks) are all reported."""
    ranks = spawn(2, 2, _log_worker)
    assert [r["action"] for r in ranks] == ["log", "log"]
    assert ranks[1]["uncorrectable"] >= 1  # counted per matrix: layer 2 heads are hit too
    origin = [(w["layer"], w["section"], w["tp_rank"]) for w in ranks[1]["where"]]
    assert (1, "scores", 1) in origin
    assert ranks[0]["where"] and all(w["layer"] == 2 for w in ranks[0]["where"])


def _rerun_worker():
    from megatron.core.rerun_state_machine import (
        RerunDataIterator,
        RerunMode,
        destroy_rerun_state_machine,
        get_rerun_state_machine,
        initialize_rerun_state_machine,
    )

    from megatron_abft import inject, validate_with_rerun

    model = _model("rerun")
    initialize_rerun_state_machine(mode=RerunMode.VALIDATE_RESULTS)
    rerun = get_rerun_state_machine()
    data = RerunDataIterator(iter([batch(SHAPE, 0), batch(SHAPE, 1)]))
    attempts, decisions = [], []
    for step in range(2):  # Megatron never re-runs the first iteration: the fault is in step 1
        attempts.append(0)
        with inject(model, [whole_matrix_fault()] if step == 1 else []):
            while rerun.should_run_forward_backward(data):
                attempts[-1] += 1
                tokens, positions, mask, labels = next(data)
                model.zero_grad()
                loss = model(tokens, positions, mask, labels=labels).float().mean()
                validate_with_rerun(model)
                loss.backward()
        decisions.append(rerun.should_checkpoint_and_exit())
    destroy_rerun_state_machine()
    return {"attempts": attempts, "decisions": decisions}


def test_rerun_hands_the_fault_to_megatrons_rerun_state_machine():
    """The faulty step is re-run in place; the fault does not come back (transient), and the
    state machine asks the job to exit with one of its codes (16: resume to disambiguate,
    17: failed validation)."""
    for rank in spawn(2, 2, _rerun_worker):
        assert rank["attempts"] == [1, 2]
        assert rank["decisions"][0] == (False, False, 0)
        _, should_exit, code = rank["decisions"][1]
        assert should_exit and code in (16, 17)


def test_finish_step_rejects_mixed_policies():
    from types import SimpleNamespace

    from megatron_abft.runtime.policy import _policy

    guards = [SimpleNamespace(config=ABFTConfig(on_uncorrectable=p)) for p in ("log", "raise")]
    with pytest.raises(ValueError, match="one on_uncorrectable policy"):
        _policy(guards)


def _unrecoverable_worker():
    from megatron_abft import ABFTUncorrectableError, finish_step, inject

    model = _model("recompute")
    with inject(model, [Fault("probs", "nan", layer=1, tp_rank=1, seed=2)]):
        loss_and_grads(model, SHAPE)  # the NaN is in the context GEMM's input: recompute can't help
    try:
        finish_step(model)
    except ABFTUncorrectableError as error:
        return str(error)
    return None


def test_a_recompute_that_cannot_help_raises_on_every_rank_together():
    """Spawns 2 ranks. The faulty rank does not raise alone in the middle of the forward (which
    would leave the other rank waiting in a collective): finish_step raises on both."""
    ranks = spawn(2, 2, _unrecoverable_worker)
    assert ranks[1] is not None and "rank 1 layer 1 section context" in ranks[1]
    assert ranks[0] is not None


def _masked_worker():
    from megatron_abft import (
        ABFTUncorrectableError,
        collect_events,
        finish_step,
        inject,
        reset_stats,
        stats,
    )
    from megatron_abft.spec import get_gpt_layer_abft_spec

    results = {}
    for padding in (False, True):  # Megatron's implicit causal mask, then an explicit mask
        shape = Shape(heads=4, groups=2, padding=padding)
        model = build_gpt(shape, get_gpt_layer_abft_spec(ABFTConfig(on_uncorrectable="raise")))
        clean = loss_and_grads(model, shape)
        for name, position, block in (
            ("masked", (2, 20), (4, 4)),
            ("straddling", (10, 8), (4, 4)),
            ("one unmasked", (4, 5), (2, 3)),  # (5, 5) below the diagonal, the rest above
        ):
            fault = Fault(
                "scores", "nan", "2d", layer=1, tp_rank=1, position=position, block=block,
                batch_index=0,
            )  # fmt: skip
            with inject(model, [fault]) as landed:
                faulty = loss_and_grads(model, shape)
            try:
                action = finish_step(model).action
            except ABFTUncorrectableError:
                action = "raised"
            scores = stats(model)["scores"]
            results[(padding, name)] = {
                "landed": len(landed),
                "action": action,
                "harmless": scores["harmless"]["masked"],
                "same": _close(faulty, clean),
                "events": [e["action"] for e in collect_events(model) if e["layer"] == 1],
            }
            reset_stats(model)
    return results


def test_a_fault_only_where_the_causal_mask_hides_the_scores_is_harmless():
    """A NaN block of S wholly above the diagonal cannot change P (the softmax writes its fill
    value there): counted as harmless, no policy acts, and the loss and gradients are the clean
    ones. A block that reaches below the diagonal stays uncorrectable and raises, but for one
    element there, which is corrected. With Megatron's implicit causal mask and with an explicit
    one."""
    rank = spawn(2, 2, _masked_worker)[1]
    for padding in (False, True):
        masked, straddling = rank[(padding, "masked")], rank[(padding, "straddling")]
        assert masked["landed"] == straddling["landed"] == 1
        assert (masked["action"], masked["harmless"], masked["same"]) == ("none", 1, True)
        assert masked["events"] == ["masked"]
        assert (straddling["action"], straddling["harmless"]) == ("raised", 0)
        assert "uncorrectable" in straddling["events"]
        partly = rank[(padding, "one unmasked")]  # the element below the diagonal is corrected
        assert (partly["action"], partly["harmless"], partly["same"]) == ("none", 0, True)
        assert partly["events"] == ["corrected"]
