"""Sequence parallelism under TP=2 (gloo, CPU): the protected model with SP on equals the stock
model (SP off: Megatron's local torch norm refuses SP where Apex is absent) in loss and
gradients, on the unfused and the flash path, and a fault in every forward section, on either
rank, and in the flash backward, is corrected."""

import pytest
import torch
from mcore import Shape, build_gpt, loss_and_grads, spawn

from megatron_abft import Fault
from megatron_abft.config import FORWARD_SECTIONS, ABFTConfig

SHAPE = Shape(heads=4, groups=2, sequence_parallel=True)
SECTIONS = ("qkv", "q", "k", "v", "scores", "context", "proj")


def _worker():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_abft import inject, stats
    from megatron_abft.spec import get_gpt_layer_abft_spec

    stock = loss_and_grads(build_gpt(Shape(heads=4, groups=2), get_gpt_layer_local_spec()), SHAPE)
    model = build_gpt(SHAPE, get_gpt_layer_abft_spec(ABFTConfig(on_uncorrectable="raise")))
    layer = model.decoder.layers[0]
    assert layer.self_attention.linear_qkv.sequence_parallel
    assert layer.input_layernorm.weight.sequence_parallel
    assert model.decoder.final_layernorm.weight.sequence_parallel
    clean = loss_and_grads(model, SHAPE)
    faulty = {}
    for i, section in enumerate(SECTIONS):
        for rank in (0, 1):
            fault = Fault(section, "nan", layer=2, tp_rank=rank, seed=i)
            with inject(model, [fault]) as landed:
                faulty[section, rank] = (loss_and_grads(model, SHAPE), len(landed))
    flash = build_gpt(SHAPE, get_gpt_layer_abft_spec(ABFTConfig(), attention="flash"))
    flash_clean = loss_and_grads(flash, SHAPE)
    with inject(flash, [Fault("grad_k", "nan", layer=2, tp_rank=1, position=(20, 3))]) as landed:
        flash_faulty = (loss_and_grads(flash, SHAPE), len(landed))
    return stock, clean, faulty, stats(model), (flash_clean, flash_faulty)


@pytest.fixture(scope="module")
def ranks():
    """Spawns 2 ranks."""
    results = spawn(2, 2, _worker)
    for rank in results:
        if isinstance(rank, Exception):
            raise rank
    return results


def _assert_equal(run, reference, rtol):
    (loss, grads), (ref_loss, ref_grads) = run, reference
    torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=0)
    assert grads.keys() == ref_grads.keys()
    for key, ref in ref_grads.items():
        torch.testing.assert_close(grads[key], ref, rtol=rtol, atol=rtol * ref.abs().max().item())


def test_clean_loss_and_gradients_equal_the_stock_model(ranks):
    for stock, clean, _, _, _ in ranks:
        _assert_equal(clean, stock, rtol=1e-5)  # the sums run in another order under SP


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("section", SECTIONS)
def test_a_fault_on_either_rank_is_corrected(ranks, section, rank):
    for this_rank, (_, clean, faulty, _, _) in enumerate(ranks):
        run, landed = faulty[section, rank]
        assert landed == (this_rank == rank)
        _assert_equal(run, clean, rtol=1e-4)


def test_every_fault_was_detected_and_corrected(ranks):
    def total(outcome):
        return sum(
            n
            for *_, table, _ in ranks
            for section in table.values()
            for n in section[outcome].values()
        )

    assert all(list(table) == list(FORWARD_SECTIONS) for *_, table, _ in ranks)  # unfused
    assert total("detected") == total("corrected") == 2 * len(SECTIONS)
    assert total("uncorrectable") == 0


def test_the_flash_attention_under_sequence_parallelism(ranks):
    """The flash path's core attention sees the whole sequence either way: clean, it equals the
    stock model to fp32 rounding; a NaN in dK on rank 1 is corrected."""
    for this_rank, (stock, *_, (clean, (faulty, landed))) in enumerate(ranks):
        _assert_equal(clean, stock, rtol=1e-4)
        assert landed == (this_rank == 1)
        _assert_equal(faulty, clean, rtol=1e-4)
