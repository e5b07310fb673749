"""Megatron-LM's ``pretrain_gpt.py`` with no edit but its flags: what its
``--spec megatron_abft.spec get_gpt_layer_abft_spec`` builds from the ``--abft-*`` flags
(``add_abft_args``, an ``extra_args_provider`` in Megatron-LM's style; megatron_abft.flags), and
the telemetry its loop gets without a call. Megatron-LM 0.19 calls the spec function with its
model config; it takes the ABFT config from Megatron-LM's global arguments
(``abft_from_megatron_lm``) and returns the protected local spec, or Megatron's own local spec
without ``--abft``. Importing this module does not import Megatron.
"""

from __future__ import annotations

import argparse
import logging
from functools import partial

from megatron_abft.config import ABFTConfig
from megatron_abft.fault_plan import FaultPlan
from megatron_abft.flags import (
    abft_config_from_args,
    add_abft_args,
    launch_problems,
    protects,
    unchecked_note,
)
from megatron_abft.runtime.model_runtime import runtime_of
from megatron_abft.runtime.telemetry import Telemetry, TelemetryConfig, say_once

_log = logging.getLogger(__name__)

__all__ = ["abft_from_megatron_lm", "add_abft_args", "megatron_lm_telemetry"]


def abft_from_megatron_lm() -> tuple[ABFTConfig | None, str, dict]:
    """What Megatron-LM's ``--spec megatron_abft.spec get_gpt_layer_abft_spec`` builds, from its
    global arguments (the flags of ``add_abft_args``): the ABFT config (None with ``--no-abft``
    and no fault injection: Megatron's own local spec), the core attention, and the local
    spec's keyword arguments. The config's runtime holds the faults of ``--abft-inject``, which
    it lands at their steps: Megatron-LM's loop injects nothing itself."""
    from megatron.training import get_args

    args = get_args()
    if not hasattr(args, "abft"):
        raise RuntimeError(
            "the ABFT flags are missing from Megatron-LM's arguments: pass "
            "extra_args_provider=megatron_abft.megatron_lm.add_abft_args to "
            "parse_and_validate_args (or to pretrain, before Megatron-LM 0.18)"
        )
    layer_kwargs = dict(
        num_experts=getattr(args, "num_experts", None),
        moe_grouped_gemm=getattr(args, "moe_grouped_gemm", False),
        qk_layernorm=getattr(args, "qk_layernorm", False),
        normalization=getattr(args, "normalization", None),
    )
    if not protects(args):
        return None, args.abft_attention, layer_kwargs
    if problems := launch_problems(args):
        raise ValueError("; ".join(problems))
    plan = FaultPlan.from_args(args)
    config = abft_config_from_args(args)
    if note := unchecked_note(config):
        say_once(_log, note, logging.WARNING)
    runtime = runtime_of(config)
    runtime.fault_plan = plan
    runtime.log_at_optimizer_steps(args.log_interval, partial(megatron_lm_telemetry, args))
    return config, args.abft_attention, layer_kwargs


def megatron_lm_telemetry(args: argparse.Namespace, modules: list) -> Telemetry:
    """The telemetry Megatron-LM's loop gets with no edit: every ``--log-interval`` steps the
    counters on the console of the last rank (where Megatron-LM logs) and the ``abft/*``
    scalars to Megatron-LM's own W&B writer (``--wandb-project``). The events file stays the
    runtime's (``--abft-events-file``: every fault not corrected in place)."""
    from megatron.training.global_vars import get_wandb_writer

    config = TelemetryConfig(
        log_interval=args.log_interval,
        train_iters=args.train_iters,
        policy=args.abft_on_uncorrectable,
    )
    return Telemetry(modules, config, num_layers=args.num_layers, wandb_run=get_wandb_writer())
