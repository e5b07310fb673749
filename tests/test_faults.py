"""Faults injected into a protected GPT under tensor parallelism are corrected on the faulty rank.

One spawn of 2 gloo ranks (TP=2) runs every case against one fault-free reference; each case is
then its own test. GQA with 2 KV groups, so each rank holds one whole group (q, k and v parts)."""

import pytest
import torch
from cuda_targets import emulator_built
from mcore import Shape, build_gpt, loss_and_grads, spawn

from megatron_abft import Fault
from megatron_abft.config import ABFTConfig

SHAPE = Shape(heads=4, groups=2)
KINDS = ["inf", "-inf", "nan", "near_inf", "bitflip", "value"]
CASES = [
    (section, kind, pattern, rank)
    for rank in (0, 1)
    for kind in KINDS
    for section, patterns in [
        ("qkv", ["0d"]),
        ("q", ["0d"]),
        ("k", ["0d"]),
        ("v", ["0d"]),
        ("scores", ["0d", "row", "col"]),
        ("context", ["0d", "row", "col"]),
        ("proj", ["0d"]),
    ]
    for pattern in patterns
]
GUARDED_BY = {
    "qkv": "qkv",
    "q": "qkv",
    "k": "qkv",
    "v": "qkv",
    "scores": "scores",
    "context": "context",
    "proj": "proj",
}


def fault_for(section, kind, pattern, rank, seed) -> Fault:
    extra = {"bit": 30} if kind == "bitflip" else {"value": 1e3} if kind == "value" else {}
    return Fault(section, kind, pattern, layer=2, tp_rank=rank, seed=seed, **extra)


def _difference(result, reference) -> float:
    """Largest relative difference of the loss and every TP-gathered gradient."""
    (loss, grads), (ref_loss, ref_grads) = result, reference
    worst = ((loss - ref_loss).abs() / ref_loss.abs()).item()
    for key, ref in ref_grads.items():
        scale = ref.abs().max().clamp_min(1e-12)
        worst = max(worst, ((grads[key] - ref).abs().max() / scale).item())
    return worst if torch.isfinite(torch.tensor(worst)) else float("inf")


def _correction_worker(cases, policy, fused_softmax=True, no_host_reads=False, emulated=False):
    """no_host_reads: every check sync-free, as on a GPU (the fused softmax corrects the scores
    itself); emulated: that, with the CUDA kernels' source run through the CUDA emulator
    (megatron_abft.ops.compiled.emulated_cuda)."""
    from megatron_abft import inject, reset_stats, stats
    from megatron_abft.ops import compiled
    from megatron_abft.runtime import guard
    from megatron_abft.spec import get_gpt_layer_abft_spec

    if emulated:
        with compiled.emulated_cuda():
            return _correction_worker(cases, policy, fused_softmax, no_host_reads, False)

    fused_checks = []
    if no_host_reads:  # every check as on a GPU: the fused softmax corrects S, no host read
        guard.host_reads = lambda config, device: False
        real = compiled.softmax_correct_tally

        def counted(*args):
            fused_checks.append(1)
            return real(*args)

        compiled.softmax_correct_tally = counted

    sync_free = True if compiled._emulating else None
    config = ABFTConfig(on_uncorrectable=policy, fused_softmax=fused_softmax, sync_free=sync_free)
    model = build_gpt(SHAPE, get_gpt_layer_abft_spec(config))
    reference = loss_and_grads(model, SHAPE)
    fused_checks.clear()
    out = []
    for i, case in enumerate(cases):
        reset_stats(model)
        with inject(model, [fault_for(*case, seed=i)]) as landed:
            result = loss_and_grads(model, SHAPE)
        out.append(
            {
                "landed": len(landed),
                "difference": _difference(result, reference),
                "stats": stats(model),
                "fused_checks": len(fused_checks),
                "backend": compiled.backend(),
            }
        )
        fused_checks.clear()
    return out


ATTENTION_CASES = [case for case in CASES if case[0] in ("scores", "context")]
"""The cases whose path the fused softmax (ABFTConfig.fused_softmax, on by default) changes."""
EMULATED_CASES = [case for case in CASES if case[3] == 1]
"""The cases on the emulated CUDA kernels: a fault on rank 1. Both ranks run every case's
kernels whichever rank the fault lands on, and which rank it lands on is CASES's to test."""


def _spawned(*args) -> list:
    ranks = spawn(2, 2, _correction_worker, *args)
    for rank, result in enumerate(ranks):
        if isinstance(result, Exception):
            raise AssertionError(f"rank {rank} failed") from result
    return ranks


@pytest.fixture(scope="module")
def corrections():
    return _spawned(CASES, "raise")


@pytest.fixture(scope="module")
def unfused_corrections():
    return _spawned(ATTENTION_CASES, "raise", False)


@pytest.fixture(scope="module")
def sync_free_corrections():
    return _spawned(ATTENTION_CASES, "raise", True, True)


@pytest.fixture(scope="module")
def emulated_corrections():
    if not emulator_built():
        pytest.skip("no CUDA emulator in this build")
    return _spawned(EMULATED_CASES, "raise", True, True, True)


def totals(stats: dict, outcome: str) -> dict[str, int]:
    return {section: sum(counts[outcome].values()) for section, counts in stats.items()}


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_a_fault_is_corrected_on_its_rank_and_training_sees_the_fault_free_values(
    corrections, case
):
    assert_corrected(corrections, CASES, case)


@pytest.mark.parametrize(
    "case", ATTENTION_CASES, ids=["-".join(map(str, c)) for c in ATTENTION_CASES]
)
def test_the_same_with_megatrons_softmax(unfused_corrections, case):
    assert_corrected(unfused_corrections, ATTENTION_CASES, case)


@pytest.mark.parametrize(
    "case", ATTENTION_CASES, ids=["-".join(map(str, c)) for c in ATTENTION_CASES]
)
def test_the_same_with_the_fused_softmax_correcting_the_scores_sync_free(
    sync_free_corrections, case
):
    """The path of a GPU's sync-free check: softmax_correct_tally corrects S and redoes P."""
    assert_corrected(sync_free_corrections, ATTENTION_CASES, case)
    for results in sync_free_corrections:
        assert results[ATTENTION_CASES.index(case)]["fused_checks"] > 0


@pytest.mark.parametrize(
    "case", EMULATED_CASES, ids=["-".join(map(str, c)) for c in EMULATED_CASES]
)
def test_the_same_on_the_emulated_cuda_kernels_sync_free(emulated_corrections, case):
    """As a GPU runs the model: every check sync-free, by the CUDA kernels (the emulator's),
    the fused softmax correcting the scores."""
    assert_corrected(emulated_corrections, EMULATED_CASES, case)
    for results in emulated_corrections:
        result = results[EMULATED_CASES.index(case)]
        assert result["backend"].startswith("cuda (emulated") and result["fused_checks"] > 0


def assert_corrected(corrections, cases, case):
    section, kind, pattern, faulty = case
    i = cases.index(case)
    for rank, results in enumerate(corrections):
        result = results[i]
        assert result["difference"] <= 1e-5, (rank, result["difference"])
        detected = totals(result["stats"], "detected")
        corrected = totals(result["stats"], "corrected")
        assert sum(totals(result["stats"], "uncorrectable").values()) == 0
        if rank == faulty:
            assert result["landed"] == 1
            expected = {s: int(s == GUARDED_BY[section]) for s in detected}
            assert detected == expected and corrected == expected
        else:
            assert result["landed"] == 0 and sum(detected.values()) == 0


def _blind_spot_worker():
    from megatron_abft import inject, stats
    from megatron_abft.spec import get_gpt_layer_abft_spec

    model = build_gpt(SHAPE, get_gpt_layer_abft_spec(ABFTConfig(on_uncorrectable="log")))
    reference = loss_and_grads(model, SHAPE)
    out = {}
    for kind, extra in (("value", {"value": 0.5}), ("nan", {})):
        with inject(model, [Fault("probs", kind, layer=1, tp_rank=0, seed=3, **extra)]):
            result = loss_and_grads(model, SHAPE)
        out[kind] = {"difference": _difference(result, reference), "stats": stats(model)}
    return out


def test_faults_in_the_softmax_output_are_outside_the_guarantee():
    """Spawns 2 ranks. A finite wrong value in P passes every check (P's checksums are taken
    from P itself) and changes training silently: the documented blind spot. A NaN in P makes
    the context checksums NaN, so it is at least reported, as uncorrectable."""
    ranks = spawn(2, 2, _blind_spot_worker)
    for result in ranks:
        if isinstance(result, Exception):
            raise result
    finite, nan = ranks[0]["value"], ranks[0]["nan"]
    assert sum(sum(c["detected"].values()) for c in finite["stats"].values()) == 0
    assert finite["difference"] > 1e-4
    assert sum(nan["stats"]["context"]["uncorrectable"].values()) >= 1


def _missing_part_worker():
    from megatron_abft import inject
    from megatron_abft.spec import get_gpt_layer_abft_spec

    shape = Shape(heads=4, groups=1)  # MQA over 2 ranks: rank 0 holds only query columns
    model = build_gpt(shape, get_gpt_layer_abft_spec())
    reference = loss_and_grads(model, shape)
    with inject(model, [Fault("k", "nan", layer=1, tp_rank=1, seed=1)]) as landed:
        corrected = _difference(loss_and_grads(model, shape), reference)
    try:  # refused when armed, before a forward could leave the other rank waiting
        with inject(model, [Fault("k", "nan", layer=1, tp_rank=0)]):
            pass
        error = None
    except ValueError as e:
        error = str(e)
    return {"landed": len(landed), "difference": corrected, "error": error}


def test_with_fewer_kv_groups_than_ranks_a_key_fault_lands_where_keys_are():
    """Spawns 2 ranks."""
    ranks = spawn(2, 2, _missing_part_worker)
    for result in ranks:
        if isinstance(result, Exception):
            raise result
    assert ranks[1]["landed"] == 1 and ranks[1]["difference"] <= 1e-5
    assert "has no columns on tensor-parallel rank 0" in ranks[0]["error"]


def test_a_fault_must_name_a_known_section():
    with pytest.raises(ValueError, match="Fault.section: unknown section 'softmax'"):
        Fault("softmax")
    with pytest.raises(ValueError, match="Fault.layer"):
        Fault("scores", layer=-1)
