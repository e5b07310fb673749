"""The command line of pretrain_gpt.py.

Megatron-LM's flags (kebab-case, ``--no-...`` for what is on by default) for the model, training,
parallelism, data, checkpoints and logging; the ABFT flags of
``megatron_abft.flags.add_abft_args``; and ``--config FILE.yaml``, which sets any flag.
Flags on the command line win over the file; a repeatable flag given on the command line
(``--abft-inject``) replaces the file's list.

In the YAML file, top-level keys are flag names without the dashes, or blocks that group them
(``model:``, ``training:``, ...). In the ``abft:`` and ``wandb:`` blocks keys drop the prefix:
``abft: {enabled: true, sections: [scores, context]}`` means ``--abft --abft-sections
scores,context``. Values are checked as the flags are, and errors name the file.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from megatron_abft.flags import add_abft_args, flag_names, launch_problems
from megatron_abft.runtime.telemetry import WANDB_MODES

PREFIXED_BLOCKS = ("abft", "wandb")
"""YAML blocks whose keys drop their flag prefix; ``enabled`` is the bare flag (``--abft``)."""

TOKENIZERS = ("NullTokenizer", "ByteLevelTokenizer")
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")


class _FlagError(Exception):
    """An argparse error raised instead of printed (to name the config file)."""


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        raise _FlagError(message)


class _Parser(argparse.ArgumentParser):
    """Prints an error once, on rank 0 of a torchrun launch, without the whole usage."""

    def error(self, message: str):  # type: ignore[override]
        if os.environ.get("RANK", "0") == "0":
            print(f"{self.prog}: error: {message}\n(--help lists the flags)", file=sys.stderr)
        sys.exit(2)


def build_parser(parser_class: type[argparse.ArgumentParser] = _Parser):
    """Every flag of the script, grouped as in Megatron-LM's arguments.py."""
    parser = parser_class(
        prog="pretrain_gpt.py",
        description="Pretrain a GPT model with Megatron-core, optionally protected by ABFT.",
        allow_abbrev=False,
    )
    parser.add_argument("--config", metavar="FILE.yaml", help="YAML file that sets any flag.")

    g = parser.add_argument_group(title="model")
    g.add_argument("--num-layers", type=int, default=2)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="Default: 4 x hidden.")
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--kv-channels", type=int, default=None, help="Default: hidden / heads.")
    g.add_argument("--seq-length", type=int, default=64)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument(
        "--position-embedding-type", choices=("learned_absolute", "rope"), default="rope"
    )
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP (Llama).")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--attention-dropout", type=float, default=0.0)
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument(
        "--use-cpu-initialization",
        action="store_true",
        help="Initialise the full weights on the CPU, then shard (the same for every TP size).",
    )
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None)
    g.add_argument("--recompute-method", choices=("uniform", "block"), default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)

    g = parser.add_argument_group(title="training")
    g.add_argument("--micro-batch-size", type=int, default=4)
    g.add_argument("--global-batch-size", type=int, default=None, help="Default: micro x DP.")
    g.add_argument("--train-iters", type=int, default=100)
    g.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=LR_DECAY_STYLES, default="cosine")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="Default: --train-iters.")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument(
        "--exit-interval", type=int, default=None, help="Stop after an iteration divisible by N."
    )
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument(
        "--no-check-for-nan-in-loss-and-grad",
        action="store_false",
        dest="check_for_nan_in_loss_and_grad",
        help="Do not stop on a NaN or INF loss (Megatron's rerun state machine checks it).",
    )

    g = parser.add_argument_group(title="distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="Split the sequence over the tensor-parallel ranks outside the attention's and "
        "MLP's GEMMs (Megatron's sequence parallelism); on with TP > 1 only.",
    )
    g.add_argument(
        "--distributed-backend",
        choices=("nccl", "gloo"),
        default=None,
        help="Default: nccl on GPUs, gloo on CPU.",
    )

    g = parser.add_argument_group(title="data")
    g.add_argument(
        "--mock-data",
        action="store_true",
        help="Megatron's MockGPTDataset (the default when no --data-path is given).",
    )
    g.add_argument(
        "--data-path",
        nargs="*",
        default=None,
        metavar="PREFIX",
        help="Indexed dataset prefixes (PREFIX.bin/.idx), as built by tools/prepare_data.py.",
    )
    g.add_argument("--split", default="100,0,0", help="Train, valid, test weights.")
    g.add_argument("--tokenizer-type", choices=TOKENIZERS, default="NullTokenizer")
    g.add_argument(
        "--vocab-size", type=int, default=128, help="Vocabulary of the NullTokenizer (mock data)."
    )
    g.add_argument(
        "--data-cache-path", default=None, help="Dataset index cache (default: <save>/data-cache)."
    )

    g = parser.add_argument_group(title="checkpointing")
    g.add_argument("--save", default=None, help="Checkpoint directory to save to.")
    g.add_argument("--load", default=None, help="Checkpoint directory to resume from.")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument(
        "--ckpt-step", type=int, default=None, help="Iteration to load (default: the latest)."
    )

    g = parser.add_argument_group(title="logging")
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--wandb-project", default=None)
    g.add_argument("--wandb-exp-name", default=None)
    g.add_argument("--wandb-save-dir", default=None, help="Default: <save>/wandb.")
    g.add_argument(
        "--wandb-mode",
        choices=WANDB_MODES,
        default=None,
        help="Default: offline unless WANDB_API_KEY is set.",
    )
    g.add_argument("--wandb-entity", default=None)

    add_abft_args(parser)
    return parser


# --- the YAML config ---------------------------------------------------------------------------


def _actions_by_flag(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {o: a for a in parser._actions for o in a.option_strings if o.startswith("--")}


def _as_text(value: Any) -> str:
    """A YAML value as the command line would spell it."""
    if isinstance(value, dict):  # section=N pairs, fault specs
        return ",".join(f"{k}={v}" for k, v in value.items())
    if isinstance(value, (list, tuple)):  # comma-separated lists
        return ",".join(str(v) for v in value)
    return str(value)


def config_to_argv(path: str, parser: argparse.ArgumentParser) -> list[list[str]]:
    """The flags a YAML config file sets, one list of tokens per flag."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise _FlagError(f"--config {path}: no such file") from None
    except yaml.YAMLError as error:
        raise _FlagError(f"--config {path}: not valid YAML: {error}") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise _FlagError(f"--config {path}: expected a mapping of flag: value at the top level")
    entries: list[tuple[str, Any]] = []
    for key, value in data.items():
        key = str(key).replace("_", "-")
        if isinstance(value, dict) and key in PREFIXED_BLOCKS:
            for sub, sub_value in value.items():
                sub = str(sub).replace("_", "-")
                entries.append((key if sub == "enabled" else f"{key}-{sub}", sub_value))
        elif isinstance(value, dict) and f"--{key}" not in _actions_by_flag(parser):
            entries.extend((str(sub).replace("_", "-"), v) for sub, v in value.items())
        else:
            entries.append((key, value))

    actions = _actions_by_flag(parser)
    argv: list[list[str]] = []
    for key, value in entries:
        flag = f"--{key}"
        if key == "config":
            raise _FlagError(f"{path}: a config file cannot name another (--config)")
        if flag not in actions and f"--no-{key}" in actions and isinstance(value, bool):
            flag, value = f"--no-{key}", not value  # abft-foo: false -> --no-abft-foo
        action = actions.get(flag)
        if action is None:
            close = difflib.get_close_matches(flag, list(flag_names(parser)), n=1)
            hint = f"; did you mean {close[0][2:]}?" if close else ""
            raise _FlagError(f"{path}: unknown key {key!r}{hint}")
        if value is None:
            continue  # null: keep the default
        if isinstance(action, argparse.BooleanOptionalAction):  # --abft / --no-abft
            if not isinstance(value, bool):
                raise _FlagError(f"{path}: {key}: {value!r} is not true or false")
            argv.append([flag if value else f"--no-{key}"])
        elif action.nargs == 0:  # store_true / store_false
            if not isinstance(value, bool):
                raise _FlagError(f"{path}: {key}: {value!r} is not true or false")
            if value:
                argv.append([flag])
        elif isinstance(action, argparse._AppendAction):
            items = value if isinstance(value, list) else [value]
            argv.extend([flag, _as_text(item)] for item in items)
        elif action.nargs in ("*", "+") and isinstance(value, list):
            argv.append([flag, *(str(v) for v in value)])
        else:
            argv.append([flag, _as_text(value)])
    return argv


# --- parsing and checks ------------------------------------------------------------------------


def parse_args(
    argv: Sequence[str] | None = None, world_size: int | None = None
) -> argparse.Namespace:
    """Parse the command line (and ``--config``), check it for a job of ``world_size`` ranks
    (default: $WORLD_SIZE, else 1) and fill in derived defaults. Exits with a message naming the
    bad value and the fix."""
    argv = list(argv) if argv is not None else sys.argv[1:]
    parser = build_parser()
    cli = parser.parse_args(argv)  # the command line alone: its own errors first
    from_file: list[list[str]] = []
    if cli.config:
        try:
            from_file = config_to_argv(cli.config, parser)
            build_parser(_RaisingParser).parse_args([t for tokens in from_file for t in tokens])
        except _FlagError as error:
            message = str(error)
            prefix = "" if message.startswith((cli.config, "--config")) else f"{cli.config}: "
            parser.error(prefix + message)
    given = {token.split("=")[0] for token in argv if token.startswith("--")}
    actions = _actions_by_flag(parser)
    from_file = [
        tokens
        for tokens in from_file
        if not (isinstance(actions[tokens[0]], argparse._AppendAction) and tokens[0] in given)
    ]
    args = parser.parse_args([t for tokens in from_file for t in tokens] + argv)
    world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    problems = check_args(args, world)
    if problems:
        parser.error("\n  ".join(problems))
    return args


def check_args(args: argparse.Namespace, world_size: int) -> list[str]:
    """Fill in derived defaults; return what is wrong, one message per problem."""
    problems: list[str] = []

    def require(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    for name in (
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "seq_length",
        "micro_batch_size",
        "train_iters",
        "log_interval",
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
    ):
        value = getattr(args, name)
        require(value >= 1, f"--{name.replace('_', '-')} {value}: use an int >= 1")
    if problems:
        return problems
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    require(
        world_size % (tp * pp) == 0,
        f"{world_size} ranks cannot hold --tensor-model-parallel-size {tp} x "
        f"--pipeline-model-parallel-size {pp}; launch a multiple of {tp * pp} ranks",
    )
    args.data_parallel_size = max(1, world_size // (tp * pp))
    args.sequence_parallel = args.sequence_parallel and tp > 1  # as Megatron-LM: none at TP=1
    require(
        args.hidden_size % args.num_attention_heads == 0,
        f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
        f"{args.num_attention_heads}",
    )
    require(
        args.num_attention_heads % tp == 0,
        f"--num-attention-heads {args.num_attention_heads} is not divisible by "
        f"--tensor-model-parallel-size {tp}",
    )
    if args.num_query_groups is not None and not args.group_query_attention:
        problems.append("--num-query-groups needs --group-query-attention (as in Megatron-LM)")
    if not args.group_query_attention:
        args.num_query_groups = None
    elif args.num_query_groups is None:
        problems.append("--group-query-attention needs --num-query-groups")
    else:
        groups = args.num_query_groups
        require(
            args.num_attention_heads % groups == 0,
            f"--num-attention-heads {args.num_attention_heads} is not divisible by "
            f"--num-query-groups {groups}",
        )
        require(
            groups % tp == 0 or tp % groups == 0,
            f"--num-query-groups {groups} and --tensor-model-parallel-size {tp}: one must "
            "divide the other",
        )
    require(
        args.num_layers % pp == 0,
        f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}",
    )
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    require(
        args.seq_length <= args.max_position_embeddings,
        f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
        f"{args.max_position_embeddings}",
    )
    dp = args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    require(
        args.global_batch_size % (args.micro_batch_size * dp) == 0,
        f"--global-batch-size {args.global_batch_size} is not a multiple of "
        f"--micro-batch-size {args.micro_batch_size} x data-parallel size {dp}",
    )
    args.num_microbatches = max(1, args.global_batch_size // (args.micro_batch_size * dp))
    require(not (args.bf16 and args.fp16), "--bf16 and --fp16 exclude each other: pick one")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    require(
        0 <= args.lr_warmup_iters < args.lr_decay_iters,
        f"--lr-warmup-iters {args.lr_warmup_iters}: use 0 up to --lr-decay-iters "
        f"({args.lr_decay_iters}, which defaults to --train-iters), exclusive",
    )
    require(
        0 <= args.min_lr <= args.lr,
        f"--min-lr {args.min_lr} must lie between 0 and --lr {args.lr}",
    )
    require(
        args.exit_interval is None or args.exit_interval >= 1,
        f"--exit-interval {args.exit_interval}: use an int >= 1",
    )
    require(
        args.save_interval is None or args.save_interval >= 1,
        f"--save-interval {args.save_interval}: use an int >= 1",
    )
    require(
        args.save_interval is None or args.save is not None,
        "--save-interval needs --save DIR",
    )
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if _cuda_available() else "gloo"
    require(
        args.distributed_backend == "gloo" or _cuda_available(),
        "--distributed-backend nccl needs GPUs and none is visible; use gloo on CPU",
    )
    if args.mock_data or not args.data_path:  # --mock-data wins over a config's data-path
        args.mock_data, args.data_path = True, None
    else:
        for prefix in args.data_path:
            missing = [p for p in (f"{prefix}.bin", f"{prefix}.idx") if not os.path.isfile(p)]
            require(
                not missing,
                f"--data-path {prefix}: {', '.join(missing)} not found; build it with "
                "python -m tools.prepare_data --input FILES --output-prefix PREFIX",
            )
    if args.tokenizer_type == "ByteLevelTokenizer":
        args.vocab_size = 256
    if args.load is not None:
        tracker = os.path.join(args.load, "latest_checkpointed_iteration.txt")
        require(
            os.path.isfile(tracker),
            f"--load {args.load}: no checkpoint there ({tracker} is missing); give the --save "
            "directory of an earlier run",
        )
        if args.ckpt_step is not None:
            step_dir = os.path.join(args.load, f"iter_{args.ckpt_step:07d}")
            require(
                os.path.isdir(step_dir),
                f"--ckpt-step {args.ckpt_step}: {step_dir} does not exist; pick an iteration "
                f"saved under {args.load}",
            )
    else:
        require(args.ckpt_step is None, "--ckpt-step needs --load DIR")
    if args.wandb_project and not args.wandb_exp_name:
        problems.append(
            f"--wandb-project {args.wandb_project} needs --wandb-exp-name (the run's name)"
        )
    if args.wandb_save_dir is None and args.wandb_project:
        args.wandb_save_dir = os.path.join(args.save or ".", "wandb")
    if args.abft_events_file is None:  # every event, in one schema, in one place
        args.abft_events_file = os.path.join(args.save or ".", "abft_events.jsonl")
    if args.data_cache_path is None and args.save is not None:
        args.data_cache_path = os.path.join(args.save, "data-cache")
    problems.extend(launch_problems(args))
    return problems


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
