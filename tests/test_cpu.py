"""megatron-core on a CPU-only host through ``enable_cpu_mode()``: TP=2 numerics, the full
Megatron training stack, activation recompute, and the patches' idempotence.

Every test starts fresh gloo processes (``mcore.start_ranks``), so no patch reaches the
pytest process. Workers run Megatron's own calls unchanged, ``model_parallel_cuda_manual_seed``
included.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from mcore import free_port, start_ranks

SEED = 1234
TINY = dict(layers=2, hidden=64, heads=4, seq=32, vocab=128, mbs=2)


@pytest.fixture(autouse=True)
def _hide_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU path is under test on any host: spawned workers see no GPU."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def _spawn(worker: Callable[..., None], nprocs: int, *args: Any) -> None:
    """Run ``worker(rank, nprocs, port, *args)`` on ``nprocs`` processes."""
    start_ranks(worker, (nprocs, free_port(), *args), nprocs)


def _init_dist(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)


def _init_model_parallel(tp: int) -> None:
    """(Re)build Megatron's parallel state for TP size ``tp`` and seed it the Megatron way."""
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)


def _start(rank: int, world: int, port: int, tp: int, *, enable_first: bool = True) -> None:
    """Worker start-up: CPU mode (before or after the gloo init), parallel state, seeds."""
    from megatron_abft.cpu import enable_cpu_mode

    if enable_first:
        assert enable_cpu_mode()
    _init_dist(rank, world, port)
    if not enable_first:
        assert enable_cpu_mode()
    _init_model_parallel(tp)


def _stop() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def _gpt(tp: int, **overrides: Any) -> torch.nn.Module:
    """The tiny GPTModel, local spec and RoPE; the same full weights for every TP size."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    settings = dict(
        num_layers=TINY["layers"],
        hidden_size=TINY["hidden"],
        num_attention_heads=TINY["heads"],
        tensor_model_parallel_size=tp,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    settings.update(overrides)
    torch.manual_seed(SEED)  # CPU init draws the full weights, then keeps this rank's shard
    return GPTModel(
        config=TransformerConfig(**settings),
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=TINY["vocab"],
        max_sequence_length=TINY["seq"],
        position_embedding_type="rope",
    )


def _batch(step: int) -> dict[str, torch.Tensor | None]:
    g = torch.Generator().manual_seed(100 + step)
    b, s = TINY["mbs"], TINY["seq"]
    tokens = torch.randint(0, TINY["vocab"], (b, s + 1), generator=g)
    return {
        "input_ids": tokens[:, :-1],
        "position_ids": torch.arange(s).expand(b, s),
        "attention_mask": None,  # Megatron builds the causal mask
        "labels": tokens[:, 1:],
    }


def _gather_tp(t: torch.Tensor, dim: int) -> torch.Tensor:
    """All-gather TP shards along ``dim`` into the TP=1 layout."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(t) for _ in range(group.size())]
    torch.distributed.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


# --- 1. TP=2 against TP=1 ------------------------------------------------------------------------


def _tp_worker(rank: int, world: int, port: int, out: str) -> None:
    from megatron.core import tensor_parallel

    _start(rank, world, port, tp=2)
    with tensor_parallel.get_cuda_rng_tracker().fork():  # the TP-rank stream, as on a GPU
        forked = torch.rand(4)
    shared = torch.rand(4)  # the default generator, common to the TP group
    expected = torch.rand(4, generator=torch.Generator().manual_seed(SEED + 2718 + rank))
    results: dict[Any, Any] = {
        "streams": {k: _gather_tp(v, 0) for k, v in [("forked", forked), ("shared", shared)]},
        "expected": _gather_tp(expected, 0),
    }
    for groups in (None, 1):  # MHA, and GQA with one KV group (< TP: the all-gather path)
        for tp in (1, 2):  # TP=1 runs as DP=2 with no gradient reduction: two equal copies
            _init_model_parallel(tp)
            model = _gpt(tp, num_query_groups=groups)
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            losses, grads = [], {}
            for step in range(3):
                opt.zero_grad()
                loss = model(**_batch(step)).float().mean()
                loss.backward()
                if step == 0:
                    attn = model.decoder.layers[0].self_attention
                    grads["qkv"] = _gather_tp(attn.linear_qkv.weight.grad, 0)
                    grads["proj"] = _gather_tp(attn.linear_proj.weight.grad, 1)
                opt.step()
                losses.append(loss.item())
            results[groups, tp] = {"losses": losses, "grads": grads}
    if rank == 0:
        torch.save(results, out)
    _stop()


def test_tp2_matches_tp1(tmp_path: Path) -> None:
    """Spawns 2 ranks: the GPTModel gives the same losses and gathered linear_qkv/linear_proj
    grads at TP=2 as at TP=1 (MHA and GQA), and dropout RNG streams are per TP rank."""
    out = str(tmp_path / "tp.pt")
    _spawn(_tp_worker, 2, out)
    r = torch.load(out)
    forked, shared = r["streams"]["forked"], r["streams"]["shared"]
    assert torch.equal(forked, r["expected"])  # seeded seed + 2718 + tp_rank
    assert not torch.equal(forked[:4], forked[4:])
    assert torch.equal(shared[:4], shared[4:])
    for groups in (None, 1):
        ref, tp2 = r[groups, 1], r[groups, 2]
        assert all(math.isfinite(x) for x in ref["losses"])
        assert tp2["losses"] == pytest.approx(ref["losses"], abs=1e-5), groups
        for name in ("qkv", "proj"):
            torch.testing.assert_close(tp2["grads"][name], ref["grads"][name], rtol=1e-4, atol=1e-6)


# --- 2. the full Megatron training stack ---------------------------------------------------------


def _stack_worker(rank: int, world: int, port: int, ckpt_dir: str, out: str) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.rerun_state_machine import (
        RerunDataIterator,
        RerunDiagnostic,
        RerunErrorInjector,
        RerunMode,
        destroy_rerun_state_machine,
        get_rerun_state_machine,
        initialize_rerun_state_machine,
    )

    _start(rank, world, port, tp=2, enable_first=False)
    # Every validated result is rejected once: the step is rerun in place from saved RNG state.
    injector = RerunErrorInjector(1, RerunDiagnostic.TRANSIENT_ERROR)
    initialize_rerun_state_machine(mode=RerunMode.VALIDATE_RESULTS, error_injector=injector)
    rerun = get_rerun_state_machine()
    gpt = _gpt(2, hidden_dropout=0.1)
    gpt.config.finalize_model_grads_func = finalize_model_grads
    model = DistributedDataParallel(gpt.config, DistributedDataParallelConfig(), gpt)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0), [model]
    )
    forward_backward = get_forward_backward_func()
    attempts: list[float] = []

    def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = output.float().mean()
        attempts.append(loss.item())
        rerun.validate_result(loss, torch.isnan, "loss is NaN", fatal=False)
        return loss, {"lm loss": loss.detach()}

    def forward_step(data_iterator, model):
        return model(**next(data_iterator)), loss_func

    data = RerunDataIterator(iter([_batch(step) for step in range(2)]))
    losses, grad_norms = [], []
    for _ in range(2):
        while rerun.should_run_forward_backward(data):
            model.zero_grad_buffer()
            optimizer.zero_grad()
            reduced = forward_backward(
                forward_step_func=forward_step,
                data_iterator=data,
                model=[model],
                num_microbatches=1,
                seq_length=TINY["seq"],
                micro_batch_size=TINY["mbs"],
            )
        assert rerun.should_checkpoint_and_exit() == (False, False, 0)
        ok, grad_norm, _ = optimizer.step()
        assert ok
        losses.append(reduced[0]["lm loss"].item())
        grad_norms.append(grad_norm)
    destroy_rerun_state_machine()

    dist_checkpointing.save(gpt.sharded_state_dict(), ckpt_dir)
    trained = {n: p.detach().clone() for n, p in gpt.named_parameters()}
    restored = _gpt(2)  # the initial weights again
    fresh = any(not torch.equal(trained[n], p) for n, p in restored.named_parameters())
    restored.load_state_dict(dist_checkpointing.load(restored.sharded_state_dict(), ckpt_dir))
    same = all(torch.equal(trained[n], p) for n, p in restored.named_parameters())
    if rank == 0:
        result = dict(losses=losses, grad_norms=grad_norms, attempts=attempts)
        torch.save({**result, "fresh": fresh, "same": same}, out)
    _stop()


def test_megatron_training_stack(tmp_path: Path) -> None:
    """Spawns 2 ranks (TP=2): DDP, get_forward_backward_func, Megatron Adam with clip_grad=1.0,
    the rerun state machine (with one in-place rerun) and a dist_checkpointing round trip."""
    out, ckpt = str(tmp_path / "stack.pt"), tmp_path / "ckpt"
    ckpt.mkdir()
    _spawn(_stack_worker, 2, str(ckpt), out)
    r = torch.load(out)
    assert all(math.isfinite(x) for x in r["losses"])
    assert all(0.0 < g < math.inf for g in r["grad_norms"])
    # Step 1 is never validated; step 2 runs twice and the rerun replays its dropout exactly.
    assert len(r["attempts"]) == 3 and r["attempts"][1] == r["attempts"][2]
    assert r["losses"] == [r["attempts"][0], r["attempts"][2]]
    assert r["fresh"] and r["same"]


# --- 3. activation recompute ---------------------------------------------------------------------

RECOMPUTE = {
    "none": {},
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "selective": dict(recompute_granularity="selective"),  # core_attn
}


def _recompute_worker(rank: int, world: int, port: int, out: str) -> None:
    _start(rank, world, port, tp=2)
    results = {}
    for name, overrides in RECOMPUTE.items():
        _init_model_parallel(2)  # the same RNG streams for every variant
        model = _gpt(2, attention_dropout=0.1, hidden_dropout=0.1, **overrides)
        loss = model(**_batch(0)).float().mean()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.eval()
        with torch.no_grad():
            eval_loss = model(**_batch(0)).float().mean().item()
        results[name] = {"loss": loss.item(), "eval_loss": eval_loss, "grads": grads}
    torch.save(results, out.format(rank=rank))
    _stop()


def test_activation_recompute_matches(tmp_path: Path) -> None:
    """Spawns 2 ranks (TP=2): full (uniform, 1 layer) and selective recompute with dropout 0.1
    give exactly the loss and grads of no recompute."""
    out = str(tmp_path / "recompute_{rank}.pt")
    _spawn(_recompute_worker, 2, out)
    for rank in range(2):
        r = torch.load(out.format(rank=rank))
        ref = r["none"]
        assert ref["loss"] != ref["eval_loss"]  # dropout is on
        for name in ("full", "selective"):
            assert r[name]["loss"] == ref["loss"], name
            for p, g in ref["grads"].items():
                torch.testing.assert_close(r[name]["grads"][p], g, rtol=0, atol=0, msg=p)


# --- 4. idempotence and the no-op with CUDA ------------------------------------------------------


def _patched_state() -> tuple[Any, ...]:
    from megatron.core import tensor_parallel
    from megatron.core.optimizer import clip_grads
    from megatron.core.transformer import utils

    cuda = torch.cuda
    return (
        tensor_parallel.get_cuda_rng_tracker(),
        cuda.current_device,
        cuda.current_stream,
        cuda.synchronize,
        cuda.get_rng_state,
        utils.torch,
        clip_grads.clip_grad_by_total_norm_fp32,
    )


def _idempotence_worker(rank: int, world: int, port: int) -> None:
    from megatron_abft import cpu

    before = _patched_state()
    is_available = torch.cuda.is_available
    torch.cuda.is_available = lambda: True
    try:
        assert cpu.enable_cpu_mode() is False
    finally:
        torch.cuda.is_available = is_available
    assert _patched_state() == before and not cpu.is_cpu_mode_enabled()

    assert cpu.enable_cpu_mode() is True
    first = _patched_state()
    assert isinstance(first[0], cpu.CpuRNGStatesTracker)
    assert all(a is not b for a, b in zip(first[1:], before[1:], strict=True))
    assert cpu.enable_cpu_mode() is True
    assert all(a is b for a, b in zip(_patched_state(), first, strict=True))

    _init_dist(rank, world, port)  # the process group may come after enable_cpu_mode
    _init_model_parallel(1)
    assert _patched_state()[0] is first[0]  # seeding keeps the installed tracker
    _stop()


def test_enable_cpu_mode_idempotent_and_noop_with_cuda() -> None:
    """Spawns 1 rank: nothing is patched when CUDA is available; a second call keeps every
    patch of the first (same tracker object, same functions)."""
    _spawn(_idempotence_worker, 1)
