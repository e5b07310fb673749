"""Pretrain a GPT model with Megatron-core; ``--abft`` protects its attention with ABFT.

    torchrun --nproc-per-node 2 -m pretrain.pretrain_gpt --config configs/tiny_cpu.yaml

Read top to bottom: the flags (pretrain/arguments.py); torch.distributed and Megatron's parallel
state (TP, PP, DP); GPTModel on the ABFT layer spec, or Megatron's local spec, inside Megatron's
DistributedDataParallel; the optimizer and its LR schedule; a checkpoint to resume from; the data
(MockGPTDataset, or an indexed dataset built by tools/prepare_data.py); then the loop. Each step
tells the ABFT guards the step, lands the faults due, runs Megatron's forward-backward schedule,
lets the ABFT policy decide what an uncorrectable fault means, and steps the optimizer. Every log
interval the fault telemetry is gathered and written (console, JSONL, W&B); checkpoints go through
dist_checkpointing. With ``--abft`` off and no faults this is a plain Megatron-core loop.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import random
import socket
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

from megatron_abft import ABFTUncorrectableError, finish_step, inject, set_step
from megatron_abft.config import Policy
from megatron_abft.fault_plan import FaultPlan
from megatron_abft.flags import abft_config_from_args, run_config, unchecked_note
from megatron_abft.runtime.guard import iter_guards
from megatron_abft.runtime.telemetry import Telemetry, TelemetryConfig, log_to_console
from pretrain.arguments import parse_args


def rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def print_rank_last(*message: object) -> None:
    """Print on the last rank, which holds the loss (last pipeline stage), as Megatron-LM does."""
    if not torch.distributed.is_initialized() or rank() == torch.distributed.get_world_size() - 1:
        print(*message, flush=True)


# --- 1. torch.distributed and Megatron's parallel state ---------------------------------------


def initialize_distributed(args) -> torch.device:
    """NCCL on GPUs, gloo on CPU (through enable_cpu_mode()); TP x PP x DP from the flags."""
    from megatron.core import parallel_state, tensor_parallel

    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        from megatron_abft.cpu import enable_cpu_mode

        enable_cpu_mode()
        device = torch.device("cpu")
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    if "RANK" not in os.environ:  # plain python, not torchrun: one rank
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group(args.distributed_backend)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
    )
    # Megatron-LM's seeding: per pipeline stage; the TP streams come from the tracker.
    seed = args.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return device


# --- 2. the model -----------------------------------------------------------------------------


def transformer_config(args):
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu,
        activation_func=torch.nn.functional.silu if args.swiglu else torch.nn.functional.gelu,
        add_bias_linear=not args.disable_bias_linear,
        attention_dropout=args.attention_dropout,
        hidden_dropout=args.hidden_dropout,
        init_method_std=args.init_method_std,
        use_cpu_initialization=args.use_cpu_initialization,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=args.bf16,
        fp16=args.fp16,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        # The local spec: no apex or Transformer Engine fusions.
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )


def padded_vocab_size(args, vocab_size: int) -> int:
    """Megatron-LM pads the vocabulary to a multiple of make-vocab-size-divisible-by x TP."""
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return math.ceil(vocab_size / multiple) * multiple


def build_model(args, vocab_size: int, device: torch.device):
    """GPTModel on the ABFT layer spec (``--abft``, or faults to inject into an unprotected model)
    or on Megatron's local spec, wrapped in Megatron's DistributedDataParallel."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    from megatron_abft.layers.norm import SequenceParallelTorchNorm, with_sequence_parallel_norms
    from megatron_abft.spec import get_gpt_layer_abft_spec

    config = transformer_config(args)
    if args.abft or FaultPlan.from_args(args).active:
        # With --abft off the protected layers run Megatron's own code; faults still land.
        spec = get_gpt_layer_abft_spec(abft_config_from_args(args), attention=args.abft_attention)
    else:
        spec = get_gpt_layer_local_spec()
    if config.sequence_parallel and transformer_block.LayerNormImpl is WrappedTorchNorm:
        # Neither Apex nor Transformer Engine: torch norms that take SP, the final one too
        spec = TransformerBlockSubmodules(
            layer_specs=[with_sequence_parallel_norms(spec)] * get_num_layers_to_build(config),
            layer_norm=SequenceParallelTorchNorm,
        )
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(args, vocab_size),
        max_sequence_length=args.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
    ).to(device)
    config.finalize_model_grads_func = finalize_model_grads
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.bf16 or args.fp16,
        use_distributed_optimizer=args.use_distributed_optimizer,
        # With ABFT the step's policy sees NaN gradients first (train_step).
        check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad and not args.abft,
    )
    return gpt, DistributedDataParallel(config, ddp_config, gpt)


# --- 3. the optimizer and its learning-rate schedule ------------------------------------------


def build_optimizer(args, model):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer=args.optimizer,
            lr=args.lr,
            min_lr=args.min_lr,
            weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1,
            adam_beta2=args.adam_beta2,
            adam_eps=args.adam_eps,
            clip_grad=args.clip_grad,
            bf16=args.bf16,
            fp16=args.fp16,
            params_dtype=model.config.params_dtype,
            use_distributed_optimizer=args.use_distributed_optimizer,
        ),
        [model],
    )
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters,
        lr_decay_steps=args.lr_decay_iters,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters,
        wd_incr_style="constant",
    )
    return optimizer, scheduler


# --- 4. checkpoints (dist_checkpointing) ------------------------------------------------------

TRACKER = "latest_checkpointed_iteration.txt"


def rng_state():
    """This rank's RNG states, one shard per (pipeline, tensor) rank as in Megatron-LM."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    pp, tp = parallel_state, parallel_state
    return ShardedObject(
        "rng_state",
        state,
        (pp.get_pipeline_model_parallel_world_size(), tp.get_tensor_model_parallel_world_size()),
        (pp.get_pipeline_model_parallel_rank(), tp.get_tensor_model_parallel_rank()),
        replica_id=parallel_state.get_data_parallel_rank(),
    )


def _write_results_in_process() -> None:
    """dist_checkpointing's writer passes its results through a queue that it makes, on first
    use, in a Manager process it spawns; the child imports this script's modules again (about
    3 s a rank on a CPU). A synchronous save, the only kind this script makes, writes from this
    process's threads, so an in-process queue carries the same results."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is None:
        filesystem_async._results_queue = queue.Queue()


def save_checkpoint(args, iteration: int, gpt, optimizer, scheduler) -> None:
    from megatron.core import dist_checkpointing

    _write_results_in_process()
    directory = os.path.join(args.save, f"iter_{iteration:07d}")
    if rank() == 0:
        os.makedirs(directory, exist_ok=True)
    torch.distributed.barrier()
    model_state = gpt.sharded_state_dict()
    state = {
        "model": model_state,
        "optimizer": optimizer.sharded_state_dict(model_state),
        "scheduler": scheduler.state_dict(),
        "iteration": iteration,
        "rng_state": rng_state(),
    }
    dist_checkpointing.save(state, directory)
    torch.distributed.barrier()
    if rank() == 0:
        Path(args.save, TRACKER).write_text(str(iteration))
    print_rank_last(f"  saved checkpoint at iteration {iteration:8d} to {args.save}")


def load_checkpoint(args, gpt, optimizer, scheduler) -> int:
    """Restore model, optimizer, LR schedule and RNG states; return the iteration."""
    from megatron.core import dist_checkpointing, tensor_parallel

    iteration = args.ckpt_step or int(Path(args.load, TRACKER).read_text().strip())
    directory = os.path.join(args.load, f"iter_{iteration:07d}")
    model_state = gpt.sharded_state_dict()
    state = {
        "model": model_state,
        "optimizer": optimizer.sharded_state_dict(model_state, is_loading=True),
        "rng_state": rng_state(),
    }
    loaded = dist_checkpointing.load(state, directory)
    gpt.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    scheduler.load_state_dict(loaded["scheduler"])
    rng = loaded["rng_state"]
    random.setstate(rng["random"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])
    print_rank_last(f"  loaded checkpoint from {args.load} at iteration {iteration}")
    return int(loaded["iteration"])


# --- 5. the data ------------------------------------------------------------------------------


def build_tokenizer(args):
    from megatron.core.tokenizers import MegatronTokenizer

    library = "byte-level" if args.tokenizer_type == "ByteLevelTokenizer" else "null-text"
    return MegatronTokenizer.from_pretrained(
        metadata_path={"library": library}, vocab_size=args.vocab_size
    )


def build_dataset(args, tokenizer):
    """The training split: MockGPTDataset, or GPTDataset over the --data-path prefixes. Rank 0
    builds (and caches) the sample indices first; the other ranks read them."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None if args.mock_data else (args.data_path, None),
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    dataset_class = MockGPTDataset if args.mock_data else GPTDataset
    samples = [args.train_iters * args.global_batch_size, 0, 0]

    def build():
        return BlendedMegatronDatasetBuilder(dataset_class, samples, lambda: True, config).build()

    if rank() == 0:
        train, _, _ = build()
    torch.distributed.barrier()
    if rank() != 0:
        train, _, _ = build()
    return train


def micro_batches(args, dataset, start_sample: int):
    """This data-parallel rank's micro-batches from sample ``start_sample`` on, as Megatron-LM's
    pretraining sampler hands them out: micro-batch i of the job takes samples
    [i x mbs x DP, (i + 1) x mbs x DP) and this rank the slice at its DP rank."""
    from megatron.core import parallel_state

    mbs, dp = args.micro_batch_size, args.data_parallel_size
    offset = parallel_state.get_data_parallel_rank() * mbs
    sample = start_sample
    while True:
        indices = range(sample + offset, sample + offset + mbs)
        yield torch.utils.data.default_collate([dataset[i % len(dataset)] for i in indices])
        sample += mbs * dp


# --- 6. one training step ---------------------------------------------------------------------


def loss_func(args, loss_mask: torch.Tensor, output: torch.Tensor):
    """Mean token loss of one micro-batch. NaN and INF are rejected through Megatron's rerun
    state machine, as in Megatron-LM (--no-check-for-nan-in-loss-and-grad turns it off). With
    ABFT the rejection waits for the step's ABFT policy (``train_step``): an uncorrectable fault
    makes the loss NaN, and the policy may skip or recompute the step."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    mask = loss_mask.view(-1).float()
    loss = torch.sum(output.float().view(-1) * mask) / mask.sum()
    if args.check_for_nan_in_loss_and_grad:
        rerun = get_rerun_state_machine()
        fatal = not args.abft or args.abft_on_uncorrectable == Policy.RERUN
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            message = f"found {what} in local forward loss calculation"
            rerun.validate_result(loss, reject, message, fatal=fatal)
    return loss, {"lm loss": loss.detach()}


def forward_step(args, gpt, device, data_iterator, model):
    batch = {k: v.to(device) for k, v in next(data_iterator).items()}
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    if args.abft_on_uncorrectable == Policy.RERUN and args.abft:
        from megatron_abft import validate_with_rerun

        validate_with_rerun(gpt)  # Megatron's rerun state machine judges this attempt
    return output, partial(loss_func, args, batch["loss_mask"])


def forward_backward(args, model, step_func, batches: list) -> list[dict]:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model.zero_grad_buffer()
    return get_forward_backward_func()(
        forward_step_func=step_func,
        data_iterator=batches,
        model=[model],
        num_microbatches=args.num_microbatches,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
    )


def train_step(args, gpt, model, optimizer, scheduler, step_func, batches: list):
    """Forward and backward inside Megatron's rerun loop, the ABFT policy, the optimizer step.
    Returns (this rank's mean loss or None off the last stage, skipped, grad norm, exit code)."""
    from megatron.core.rerun_state_machine import RerunDataIterator, get_rerun_state_machine

    rerun = get_rerun_state_machine()
    data = RerunDataIterator(iter(batches))
    while rerun.should_run_forward_backward(data):
        optimizer.zero_grad()
        losses = forward_backward(args, model, step_func, data)
    if args.abft and args.abft_on_uncorrectable != Policy.RERUN:
        try:
            outcome = finish_step(gpt)  # one host sync and one tiny all-reduce per step
            if outcome.recompute:  # (GPU) an uncorrectable fault: run the step once more
                optimizer.zero_grad()
                losses = forward_backward(args, model, step_func, iter(batches))
                outcome = finish_step(gpt, retried=True)  # raises if the fault is still there
        except ABFTUncorrectableError as error:
            error.on_every_rank = True  # finish_step raises on every rank together
            raise
        skip, action = outcome.skip, outcome.action
    else:
        skip, action = False, "none"
    loss = torch.stack([x["lm loss"] for x in losses]).mean() if losses else None
    if args.abft and args.check_for_nan_in_loss_and_grad and not skip and loss is not None:
        if not torch.isfinite(loss):  # the step is not skipped: stop, as Megatron would
            cause = (
                "ABFT found no uncorrectable fault in the checked GEMMs (the fault is elsewhere)"
                if action == "none"
                else f"after an uncorrectable fault that policy {action} let through"
            )
            error = RuntimeError(
                f"Rank {rank()}, node {socket.gethostname()}: the loss is {loss.item()}; {cause}"
            )
            # with one pipeline stage every rank holds the loss and raises here together
            error.on_every_rank = args.pipeline_model_parallel_size == 1
            raise error
    save, stop, exit_code = rerun.should_checkpoint_and_exit()
    grad_norm = None
    if not skip and not stop:
        updated, grad_norm, _ = optimizer.step()
        skip = not updated
        if updated:
            scheduler.step(increment=1)
    return loss, skip, grad_norm, (save, stop, exit_code)


# --- 7. the loop ------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    log_to_console()
    device = initialize_distributed(args)
    from megatron.core import parallel_state
    from megatron.core.rerun_state_machine import (
        RerunMode,
        get_rerun_state_machine,
        initialize_rerun_state_machine,
    )

    tokenizer = build_tokenizer(args)
    gpt, model = build_model(args, tokenizer.vocab_size, device)
    optimizer, scheduler = build_optimizer(args, model)
    iteration = load_checkpoint(args, gpt, optimizer, scheduler) if args.load else 0
    dataset = build_dataset(args, tokenizer)
    data = micro_batches(args, dataset, start_sample=iteration * args.global_batch_size)
    rerun = args.abft and args.abft_on_uncorrectable == Policy.RERUN
    initialize_rerun_state_machine(mode=RerunMode("validate_results" if rerun else "disabled"))
    get_rerun_state_machine().current_iteration = iteration - 1  # its messages count from 1

    plan = FaultPlan.from_args(args)
    local_layers = {g.layer for g in iter_guards(gpt)}
    telemetry = Telemetry(
        gpt,
        TelemetryConfig(
            log_interval=args.log_interval,
            train_iters=args.train_iters,
            events_file=args.abft_events_file,
            policy=args.abft_on_uncorrectable,
            wandb_project=args.wandb_project,
            wandb_exp_name=args.wandb_exp_name,
            wandb_save_dir=args.wandb_save_dir,
            wandb_mode=args.wandb_mode,
            wandb_entity=args.wandb_entity,
            run_config=run_config(args),
        ),
        num_layers=args.num_layers,
        device=device,
    )
    world = torch.distributed.get_world_size()
    print_rank_last(
        f"> GPT: {args.num_layers} layers, hidden {args.hidden_size}, {args.num_attention_heads} "
        f"heads, seq {args.seq_length}; {world} ranks: TP={args.tensor_model_parallel_size} "
        f"PP={args.pipeline_model_parallel_size} DP={args.data_parallel_size} "
        f"({args.distributed_backend}); data: "
        f"{'MockGPTDataset' if args.mock_data else ' '.join(args.data_path)}\n"
        f"> ABFT: {_abft_banner(args, plan, gpt)}"
    )
    step_func = partial(forward_step, args, gpt, device)
    logged_losses: dict[int, float] = {}
    interval_losses: list[torch.Tensor] = []
    skipped = nan_iterations = 0
    last_saved = iteration if args.load else None
    start, tick = time.perf_counter(), time.perf_counter()
    first = iteration
    try:
        while iteration < args.train_iters:
            iteration += 1
            set_step(gpt, iteration)  # drives check intervals and which faults land
            faults = [f for f in plan.at(iteration) if f.layer is None or f.layer in local_layers]
            batches = [next(data) for _ in range(args.num_microbatches)]
            with inject(gpt, faults) if faults else contextlib.nullcontext([]) as landed:
                loss, skip, grad_norm, (save, stop, code) = train_step(
                    args, gpt, model, optimizer, scheduler, step_func, batches
                )
            telemetry.count_injected(len(landed))
            skipped += int(skip)
            if loss is not None and not skip:  # as Megatron-LM, skipped steps are not averaged
                interval_losses.append(loss)
            if save and args.save:
                save_checkpoint(args, iteration, gpt, optimizer, scheduler)
            if stop:
                telemetry.log(iteration)
                telemetry.close()
                print_rank_last(f"Megatron's rerun state machine stops the job (exit {code})")
                sys.exit(code)
            if iteration % args.log_interval == 0 or iteration == args.train_iters:
                loss_value = _data_parallel_mean(interval_losses)
                interval_losses = []
                nan_iterations += int(loss_value is not None and not math.isfinite(loss_value))
                now = time.perf_counter()
                elapsed, tick = (now - tick) / ((iteration - first) or 1), now
                first = iteration
                metrics = {
                    "consumed-samples": iteration * args.global_batch_size,
                    "iteration-time": elapsed,
                    "tokens-per-sec": args.global_batch_size * args.seq_length / elapsed,
                    "learning-rate": scheduler.get_lr(optimizer.param_groups[0]),
                    "batch-size": args.global_batch_size,
                }
                if loss_value is not None:
                    metrics["lm loss"] = loss_value
                    logged_losses[iteration] = loss_value
                if grad_norm is not None:
                    metrics["grad-norm"] = float(grad_norm)
                metrics["skipped-iterations"] = skipped
                metrics["nan-iterations"] = nan_iterations
                telemetry.log(iteration, metrics)
            if args.save and args.save_interval and iteration % args.save_interval == 0:
                save_checkpoint(args, iteration, gpt, optimizer, scheduler)
                last_saved, tick = iteration, time.perf_counter()  # time steps, not saves
            if args.exit_interval and iteration % args.exit_interval == 0:
                print_rank_last(f"exiting after iteration {iteration} (--exit-interval)")
                break
        if args.save and last_saved != iteration:
            save_checkpoint(args, iteration, gpt, optimizer, scheduler)
    except RuntimeError as error:  # ABFTUncorrectableError, or the stop on a NaN loss
        if getattr(error, "on_every_rank", False):  # the events still reach every sink
            telemetry.log(iteration)
        telemetry.close()
        raise
    summary = {
        "iterations": iteration,
        "final_loss": logged_losses[max(logged_losses)] if logged_losses else None,
        "losses": {str(k): v for k, v in logged_losses.items()},
        **{f"faults_{k}": v for k, v in telemetry.previous.items()},
        "skipped_iterations": skipped,
        "abft": bool(args.abft),
        "events_file": os.path.abspath(args.abft_events_file) if args.abft_events_file else None,
        "wandb_dir": telemetry.wandb_dir and os.path.abspath(telemetry.wandb_dir),
        "wall_seconds": time.perf_counter() - start,
    }
    telemetry.close({"final lm loss": summary["final_loss"]})
    if telemetry.is_logging_rank:
        print(_summary_table(summary), flush=True)
        if args.save:
            Path(args.save, "summary.json").write_text(json.dumps(summary, indent=1))
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def _data_parallel_mean(losses: list[torch.Tensor]) -> float | None:
    """The interval's mean loss over steps and data-parallel ranks (last pipeline stage only)."""
    from megatron.core import parallel_state

    if not losses:
        return None
    mean = torch.stack(losses).mean().float()
    torch.distributed.all_reduce(mean, group=parallel_state.get_data_parallel_group())
    return (mean / parallel_state.get_data_parallel_world_size()).item()


def _abft_banner(args, plan: FaultPlan, model: torch.nn.Module) -> str:
    """ABFT's line of the start banner: the attention built, and the sections it checks."""
    from megatron_abft.layers.flash_attention import ProtectedFlashAttention

    if args.abft:
        config = abft_config_from_args(args)
        built = {guard.section for guard in iter_guards(model)}
        sections = [s for s in config.sections if s in built]
        intervals = ",".join(f"{s}={config.interval(s)}" for s in sections) or "none"
        flash = any(isinstance(m, ProtectedFlashAttention) for m in model.modules())
        text = (
            f"on, {'flash' if flash else 'unfused'} attention: check every N steps {intervals}, "
            f"uncorrectable -> {config.on_uncorrectable}"
        )
        note = unchecked_note(config)
        if args.abft_coverage_target is not None:
            text += (
                f" (intervals for coverage {args.abft_coverage_target} at fault rates "
                f"{args.abft_fault_rates})"
            )
    else:
        text, note = "off (Megatron's local layers)", None
    if plan.active:
        text += f"; injecting {len(plan.explicit)} faults"
        if plan.every:
            text += f" + one random fault every {plan.every} steps ({','.join(plan.sections)})"
    if note:
        text += f"\n{note}"
    return text


def _summary_table(summary: dict) -> str:
    rows = [
        ("faults injected", summary["faults_injected"]),
        ("faults detected", summary["faults_detected"]),
        ("faults corrected", summary["faults_corrected"]),
        ("faults uncorrectable", summary["faults_uncorrectable"]),
        ("GEMMs recomputed", summary["faults_recomputed"]),
        ("skipped iterations", summary["skipped_iterations"]),
        (
            "final lm loss",
            "n/a" if summary["final_loss"] is None else f"{summary['final_loss']:.6f}",
        ),
    ]
    lines = [f"ABFT summary after {summary['iterations']} iterations on {socket.gethostname()}"]
    lines += [f"  {name:<22} {value:>12}" for name, value in rows]
    if summary["events_file"] and os.path.exists(summary["events_file"]):  # none: no event
        lines.append(f"  fault events (JSONL): {summary['events_file']}")
    if summary["wandb_dir"]:
        lines.append(f"  W&B run: {summary['wandb_dir']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
