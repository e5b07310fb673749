"""Train a GPT with Megatron-LM's own training loop (``megatron.training.pretrain``, megatron-core
0.19) on ABFT-protected attention; print megatron_abft's counters at the end::

    torchrun --nproc-per-node 1 -m tools.megatron_lm_pretrain <Megatron-LM flags> \\
        --abft [--abft-attention flash|unfused] [--abft-inject SPEC ...]

As Megatron-LM 0.19's ``pretrain_gpt.py`` does: its parser reads the flags (here with the
``--abft*`` flags of ``add_abft_args``), pretrain() builds the model from a ``GPTModelConfig`` on
the layer spec of ``--spec``, or of ``get_gpt_layer_abft_spec`` with ``--abft`` (or faults) and no
``--spec``; MockGPTDataset (``--mock-data``) or GPTDataset through BlendedMegatronDatasetBuilder;
its batch, forward step and loss, for tensor and data parallelism. The loop is Megatron-LM's,
unedited: the ABFT runtime reads its iteration, lands ``--abft-inject`` faults at their steps and
settles uncorrectable faults by ``--abft-on-uncorrectable`` (docs/megatron.md). At the end, also
after a failure: ``ABFT_SUMMARY {json}``, the counters by section and kind (summed over ranks),
the faults that landed and the events the guards logged. pretrain() needs CUDA.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile

import torch
from megatron.core import mpu
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.utils import get_batch_on_this_tp_rank
from megatron.training import get_args, get_tokenizer, pretrain, print_rank_0
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args
from megatron.training.utils import get_blend_and_blend_per_split

from megatron_abft import collect_events, stats
from megatron_abft.megatron_lm import add_abft_args
from megatron_abft.runtime.guard import iter_guards
from megatron_abft.runtime.model_runtime import runtimes
from megatron_abft.spec import get_gpt_layer_abft_spec

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")
OUTCOMES = ("detected", "corrected", "uncorrectable", "recomputed")
MODELS: list[torch.nn.Module] = []
"""The model chunks pretrain() trains, as its builder wrapped them (the post-wrap hook)."""


def keep_models(models: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """Post-wrap hook of the model config: remember the chunks for the summary."""
    MODELS[:] = models
    return models


def model_config(args):
    """Megatron-LM's GPTModelConfig from the flags, on the layer spec of ``--spec``, or the ABFT
    spec where ``--abft`` or faults ask for it and no ``--spec`` is given."""
    config = gpt_config_from_args(args)
    if args.spec is None and (args.abft or args.abft_inject or args.abft_inject_every):
        config.transformer_layer_spec = get_gpt_layer_abft_spec  # reads the --abft* flags
    config.post_wrap_hooks.append(keep_models)
    return config


def datasets_provider(num_samples, vp_stage=None):
    """Train, valid and test GPT datasets: MockGPTDataset with ``--mock-data``, else GPTDataset
    over ``--data-path``, built on tensor-parallel rank 0 by BlendedMegatronDatasetBuilder."""
    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )
    dataset = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0(f"> building {dataset.__name__} train, validation and test datasets ...")
    on_rank = lambda: mpu.get_tensor_model_parallel_rank() == 0  # noqa: E731
    return BlendedMegatronDatasetBuilder(dataset, num_samples, on_rank, config).build()


datasets_provider.is_distributed = True  # every rank calls it; it builds on TP rank 0


def get_batch(data_iterator) -> dict:
    """One micro-batch, read on tensor-parallel rank 0 and broadcast to the others."""
    args = get_args()
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        data = next(data_iterator)
        batch = {k: None if data.get(k) is None else data[k].to(device) for k in BATCH_KEYS}
    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        cp_size=1,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=False,
    )
    return batch


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """The masked sum of token losses, the token count, and ``lm loss`` for Megatron's log;
    a NaN or Inf loss goes to Megatron's rerun state machine, as in ``pretrain_gpt.py``."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    if get_args().check_for_nan_in_loss_and_grad:
        machine = get_rerun_state_machine()
        for rejects, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            message = f"found {what} in local forward loss calculation"
            machine.validate_result(loss, rejects, message=message, tolerance=0.0, fatal=True)
    return loss, num_tokens, {"lm loss": torch.cat([loss.detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    """Megatron-LM's GPT forward step: the model's per-token losses and the loss function."""
    batch = get_batch(data_iterator)
    inputs = (batch[k] for k in ("tokens", "position_ids", "attention_mask"))
    output = model(*inputs, labels=batch["labels"], loss_mask=batch["loss_mask"])
    return output, lambda out: loss_func(batch["loss_mask"], out)


def allow_prebuilt_dataset_helpers() -> None:
    """Megatron-LM's initialisation runs ``make -C megatron/core/datasets`` to build its C++
    dataset helpers and exits if make fails; the megatron-core wheel ships them built, but no
    Makefile. Where they import, give make (its MAKEFILES variable) a rule that does nothing in
    that folder alone, or, with no make at all, a make that does nothing. Megatron is unchanged."""
    import megatron.core.datasets as datasets

    folder = os.path.realpath(os.path.dirname(datasets.__file__))
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return  # not built: Megatron's make says why
    if os.path.exists(os.path.join(folder, "Makefile")):
        return
    where = tempfile.mkdtemp(prefix="abft-make-")
    with open(os.path.join(where, "prebuilt.mk"), "w") as rules:
        rules.write(f"ifeq ($(CURDIR),{folder})\n.DEFAULT_GOAL := prebuilt\nendif\n")
        rules.write("prebuilt:\n\t@:\n")
    os.environ["MAKEFILES"] = f"{os.environ.get('MAKEFILES', '')} {rules.name}".strip()
    if shutil.which("make") is None:
        with open(os.path.join(where, "make"), "w") as make:
            make.write("#!/bin/sh\nexit 0\n")
        os.chmod(make.name, 0o755)
        os.environ["PATH"] = f"{where}{os.pathsep}{os.environ.get('PATH', '')}"


def abft_summary(collective: bool) -> dict:
    """megatron_abft's counters over the trained chunks, summed over all ranks (``collective``)
    or this rank's, by section and by kind; the faults that landed and the events logged."""
    group = torch.distributed.group.WORLD if collective else None
    by_kind: dict = {}
    for table in (stats(chunk, group) for chunk in MODELS):
        for section, outcomes in table.items():
            for outcome, kinds in outcomes.items():
                for kind, n in ((k, n) for k, n in kinds.items() if n):
                    cell = by_kind.setdefault(section, {}).setdefault(outcome, {})
                    cell[kind] = cell.get(kind, 0) + n
    sections = {s: {o: sum(t.get(o, {}).values()) for o in OUTCOMES} for s, t in by_kind.items()}
    guards = [g for chunk in MODELS for g in iter_guards(chunk)]
    landed = [dict(f, injection=str(f["injection"])) for r in runtimes(guards) for f in r.landed]
    events = [e for chunk in MODELS for e in collect_events(chunk)]
    if collective and torch.distributed.get_world_size() > 1:
        gathered = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, (landed, events))
        landed = [f for part, _ in gathered for f in part]
        events = [e for _, part in gathered for e in part]
    finite = lambda v: str(v) if isinstance(v, float) and not math.isfinite(v) else v  # noqa: E731
    return {
        "summed_over_ranks": collective,
        "protected_layers": len({(g.layer, g.tp_rank) for g in guards}),
        "totals": {o: sum(t[o] for t in sections.values()) for o in OUTCOMES},
        "sections": sections,
        "by_kind": by_kind,
        "injected": landed,
        "events": [{k: finite(v) for k, v in e.items()} for e in events[:200]],
    }


def main() -> None:
    """Parse Megatron-LM's flags and the ABFT flags, then hand everything to pretrain()."""
    args = parse_and_validate_args(extra_args_provider=add_abft_args)
    if args.pipeline_model_parallel_size > 1 or args.context_parallel_size > 1:
        raise SystemExit("megatron_lm_pretrain.py runs tensor and data parallelism only")
    config = pretrain_cfg_container_from_args(args, model_config(args))
    allow_prebuilt_dataset_helpers()
    finished = False
    try:
        pretrain(config, datasets_provider, ModelType.encoder_or_decoder, forward_step)
        finished = True
    finally:
        collective = finished and torch.distributed.is_initialized()
        summary = abft_summary(collective)
        if not collective or torch.distributed.get_rank() == 0:
            print("ABFT_SUMMARY " + json.dumps(summary, default=str), flush=True)


if __name__ == "__main__":
    main()
