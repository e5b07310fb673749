"""The ``--abft-*`` command line, in one place for Megatron-LM's parser and
``pretrain/pretrain_gpt.py``: the flags, those of ``ABFTConfig``'s fields made from the fields
(their help the fields' docstrings, ``CONFIG_FLAGS``), the others describing the launch (the
attention, faults to inject, the check-frequency optimizer); the ``ABFTConfig`` they build
(``abft_config_from_args``); and what in them cannot run, refused before any rank trains
(``launch_problems``; on Megatron-LM's parser also ``megatron_lm_problems``, while it parses).
Importing this module does not import Megatron."""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import itertools
import json
import logging
import math
import os
import sys
import textwrap
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from enum import Enum
from pathlib import Path
from typing import Any

from megatron_abft.check.eec import KINDS
from megatron_abft.config import (
    ATTENTIONS,
    BACKWARD_SECTIONS,
    FORWARD_SECTIONS,
    POLICIES,
    SECTIONS,
    ABFTConfig,
    Policy,
)
from megatron_abft.fault_plan import (
    FAULT_KEYS,
    STREAM_SECTIONS,
    FaultPlan,
    fault_spec,
    parse_fault,
    parse_inject_sections,
)
from megatron_abft.faults import FAULT_KINDS, MODEL_SECTIONS, PATTERNS, Fault
from megatron_abft.runtime.telemetry import say_once
from megatron_abft.tuning.devices import DEVICES
from megatron_abft.tuning.frequency import DEFAULT_VULNERABILITY, choose_intervals, harm
from megatron_abft.tuning.scaling import baseline_forward, predict
from megatron_abft.tuning.shapes import ModelShape

_log = logging.getLogger(__name__)


def _sections(text: str) -> tuple[str, ...]:
    try:
        sections = ABFTConfig(sections=text).sections
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error).replace("ABFTConfig.sections: ", "")) from None
    if not sections:
        raise argparse.ArgumentTypeError(
            f"{text!r} names no section; name at least one of {', '.join(SECTIONS)} (or leave "
            "out --abft to check none)"
        )
    return sections


def _block_size(text: str) -> int:
    try:
        return ABFTConfig(block_size=int(text)).block_size
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int between 2 and 65536") from None


def parse_check_interval(text: str | int) -> int | dict[str, int]:
    """``4`` (every section every 4th step) or ``scores=1,qkv=4`` (per section, others 1)."""
    text = str(text).strip()
    try:
        if "=" not in text:
            interval: int | dict[str, int] = int(text)
        else:
            interval = {}
            for item in text.split(","):
                section, _, every = item.partition("=")
                interval[section.strip()] = int(every)
        ABFTConfig(check_interval=interval)
    except ValueError as error:
        raise argparse.ArgumentTypeError(
            f"{text!r}: {str(error).replace('ABFTConfig.', '')}. Use N (every N-th step) or "
            f"section=N pairs such as scores=1,qkv=4 (sections: {', '.join(SECTIONS)})"
        ) from None
    return interval


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int >= 0 (0 = off)")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive finite number")
    return value


AS_CONFIG = object()
"""ConfigFlag.default: the config's own default."""


@dataclass(frozen=True)
class ConfigFlag:
    """How the command line spells one ABFTConfig field. Its help is the field's docstring
    (``field_docstrings``), then ``note``; a bool field is a switch with a ``--no-`` form, and
    a field the type or choices do not describe takes a string."""

    type: Callable[[str], Any] | None = None
    """Parses and checks the value, naming what is wrong (argparse.ArgumentTypeError)."""
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    default: Any = AS_CONFIG
    """The command line's default, where it is not the config's."""
    note: str = ""
    """What the command line adds to the docstring: its own default, what it means there."""


CONFIG_FLAGS: dict[str, ConfigFlag] = {
    "enabled": ConfigFlag(
        default=False,
        note="On the command line off by default: without --abft and without faults to inject "
        "the model is built from Megatron's own local layers.",
    ),
    "sections": ConfigFlag(_sections, "LIST"),
    "check_interval": ConfigFlag(parse_check_interval, "N|SECTION=N,..."),
    "block_size": ConfigFlag(_block_size, "N"),
    "threshold_scale": ConfigFlag(_positive_float, "SCALE"),
    "near_inf": ConfigFlag(_positive_float, "MAGNITUDE"),
    "sync_free": ConfigFlag(),
    "fused_softmax": ConfigFlag(),
    "checked_gemm": ConfigFlag(),
    "on_uncorrectable": ConfigFlag(
        choices=POLICIES,
        note="Every such fault is printed and recorded. The command line's default: rerun "
        "under Megatron-LM's own parser (its rerun state machine; there recompute and skip_step "
        "act as raise, and log trains on), recompute in pretrain_gpt.py (docs/megatron.md).",
    ),
    "events_file": ConfigFlag(
        metavar="PATH",
        default=None,
        note="The command line's default: <save>/abft_events.jsonl when --save is set, else "
        "./abft_events.jsonl, written only when a fault is found.",
    ),
}
"""The flag of every ABFTConfig field the constructor takes: ``--abft`` for ``enabled``,
``--abft-<field>`` for the others (tests/test_pretrain.py holds the two together)."""


def config_flag(name: str) -> str:
    """The command-line flag of ABFTConfig field ``name``."""
    return "--abft" if name == "enabled" else "--abft-" + name.replace("_", "-")


def config_dest(name: str) -> str:
    """Where the parsed arguments hold ABFTConfig field ``name`` (``args.abft_block_size``)."""
    return config_flag(name)[2:].replace("-", "_")


@functools.cache
def field_docstrings() -> dict[str, str]:
    """ABFTConfig's field docstrings (the string under each field) as plain text: whitespace
    collapsed, no literal markers."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(ABFTConfig)))
    body = tree.body[0].body
    docs = {}
    for statement, following in itertools.pairwise(body):
        if (
            isinstance(statement, ast.AnnAssign)
            and isinstance(statement.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            text = following.value.value.replace("``", "")
            docs[statement.target.id] = " ".join(text.split())
    return docs


def add_config_flags(group: argparse._ArgumentGroup) -> None:
    """One flag for every field of CONFIG_FLAGS, its help the field's docstring."""
    defaults = {f.name: f.default for f in fields(ABFTConfig) if f.init}
    hints = typing.get_type_hints(ABFTConfig)
    for name, spec in CONFIG_FLAGS.items():
        default = defaults[name] if spec.default is AS_CONFIG else spec.default
        if isinstance(default, Enum):
            default = default.value
        text = " ".join(filter(None, (field_docstrings()[name], spec.note)))
        options: dict[str, Any] = {"default": default, "help": text.replace("%", "%%")}
        if hints[name] in (bool, bool | None):  # --x sets True, --no-x False
            options["action"] = argparse.BooleanOptionalAction
            options["help"] += f" ({config_flag(name)}: True, --no-{config_flag(name)[2:]}: False)"
        else:
            options.update(type=spec.type, metavar=spec.metavar, choices=spec.choices)
        group.add_argument(config_flag(name), dest=config_dest(name), **options)


def add_abft_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ABFT flags to ``parser``, in their own group; returns the parser (Megatron-LM's
    ``extra_args_provider`` contract). On Megatron-LM's parser, parsing then also refuses, one
    line each and before any rank starts, what the protected layers cannot run
    (megatron_lm_problems)."""
    group = parser.add_argument_group(
        title="abft", description="Algorithm-based fault tolerance for attention (megatron_abft)"
    )
    add_config_flags(group)
    group.add_argument(
        "--abft-attention",
        choices=ATTENTIONS,
        default="auto",
        help="The protected core attention: flash (Triton kernels that check every tile GEMM "
        "of the forward and the backward; needs --attention-dropout 0 and a causal mask), "
        "unfused (Megatron's unfused attention with its scores and context checked), or auto "
        "(flash where the kernels compile for the GPU and take the layer, unfused elsewhere, "
        "for instance with attention dropout; it prints which and why).",
    )
    group.add_argument(
        "--abft-inject",
        type=parse_fault,
        action="append",
        default=None,
        metavar="SPEC",
        help="Inject one fault, e.g. section=scores,layer=1,kind=inf,step=20,tp-rank=1 "
        f"(keys: {', '.join(FAULT_KEYS)}; sections: {', '.join(MODEL_SECTIONS)}; kinds: "
        f"{', '.join(FAULT_KINDS)}; patterns: {', '.join(PATTERNS)}). Repeatable.",
    )
    group.add_argument(
        "--abft-inject-every",
        type=_non_negative,
        default=0,
        metavar="N",
        help="Inject one seeded random fault every N steps (0: off), into a random section, "
        "layer and tensor-parallel rank.",
    )
    group.add_argument(
        "--abft-inject-sections",
        type=parse_inject_sections,
        default=STREAM_SECTIONS,
        metavar="LIST",
        help="Sections of the random faults (default: all but probs, the softmax output that "
        "GEMM checksums cannot cover).",
    )
    group.add_argument(
        "--abft-inject-seed",
        type=int,
        default=None,
        help="Seed of the random faults (default: --seed).",
    )
    group.add_argument(
        "--abft-coverage-target",
        type=_fraction,
        default=None,
        metavar="P",
        help="Pick per-section check intervals that catch this share of harmful faults at least "
        "cost (the check-frequency optimizer, megatron_abft.tuning.frequency); overrides "
        "--abft-sections and --abft-check-interval. It weighs the forward sections; the flash "
        "attention's backward sections are checked every step when P > 0.",
    )
    group.add_argument(
        "--abft-fault-rates",
        type=parse_fault_rates,
        default={"inf": 1.0, "nan": 1.0, "near_inf": 1.0, "finite": 1.0},
        metavar="KIND=RATE,...",
        help="Relative rates of each kind of fault (inf, nan, near_inf, finite) for "
        "--abft-coverage-target (default: all equal).",
    )
    group.add_argument(
        "--abft-vulnerability",
        default=None,
        metavar="FILE.json",
        help="Per-section chance that a fault of each kind makes training non-trainable "
        '({"scores": {"inf": 1.0, ...}, ...}, as tools/fault_campaign.py writes it); default: '
        "megatron_abft.tuning.frequency.DEFAULT_VULNERABILITY in every section.",
    )
    group.add_argument(
        "--abft-cost-device",
        choices=tuple(DEVICES),
        default="H100",
        help="Device profile of check costs for the coverage optimizer (tuning/devices.json).",
    )
    parse = parser.parse_known_args  # parse_args calls it too

    def parse_and_check(args=None, namespace=None):
        parsed, rest = parse(args, namespace)
        if hasattr(parsed, "transformer_impl"):  # Megatron-LM's parser
            if problems := megatron_lm_problems(parsed):
                _refuse(parser.prog, problems)
            tokens = sys.argv[1:] if args is None else args
            given = any(t.split("=")[0] == "--abft-on-uncorrectable" for t in tokens)
            _megatron_lm_policy(parsed, given)
        return parsed, rest

    parser.parse_known_args = parse_and_check  # type: ignore[method-assign]
    return parser


def protects(args: argparse.Namespace) -> bool:
    """Whether the flags build the protected layers: ``--abft``, or faults to inject."""
    return bool(args.abft or args.abft_inject or args.abft_inject_every)


def megatron_lm_problems(args: argparse.Namespace) -> list[str]:
    """What the protected layers cannot run among Megatron-LM's flags, and launch_problems,
    one message each naming the fix; nothing without --abft or faults."""
    if not protects(args):
        return []
    problems = []
    if args.transformer_impl != "local":
        problems.append(
            f"--transformer-impl {args.transformer_impl}: the protected layers are Megatron-core's "
            "local ones; add --transformer-impl local"
        )
    if getattr(args, "fp8", None):
        problems.append(
            f"--fp8-format {args.fp8}: FP8 GEMMs are not protected (the checks bound bf16, fp16 "
            "and fp32 rounding); drop --fp8-format"
        )
    if args.context_parallel_size != 1:
        problems.append(
            f"--context-parallel-size {args.context_parallel_size}: its ring attention exchanges "
            "partial results the checks do not cover; use 1"
        )
    if pattern := getattr(args, "hybrid_layer_pattern", None) or getattr(
        args, "hybrid_override_pattern", None
    ):
        problems.append(
            f"--hybrid-layer-pattern {pattern}: HybridModel is not protected (megatron-core "
            "0.19 builds its stack from Transformer Engine layers and Mamba mixers, which the "
            "checks do not cover); train a GPTModel with pretrain_gpt.py"
        )
    if args.abft_on_uncorrectable == Policy.RERUN and getattr(args, "rerun_mode", "") == "disabled":
        problems.append(
            "--abft-on-uncorrectable rerun needs Megatron's rerun state machine, which "
            "--rerun-mode disabled turns off; use validate_results, or another policy"
        )
    return problems + launch_problems(args)


def _megatron_lm_policy(args: argparse.Namespace, given: bool) -> None:
    """Megatron-LM's loop makes no ABFT call, so recompute and skip_step cannot act there: the
    default becomes rerun (its rerun state machine; raise with ``--rerun-mode disabled``), and a
    policy asked for that acts as raise is said so at start."""
    if not protects(args):
        return
    if not given:  # raise where the machine is off (--rerun-mode disabled would ignore it)
        machine = getattr(args, "rerun_mode", "validate_results") != "disabled"
        args.abft_on_uncorrectable = Policy.RERUN if machine else Policy.RAISE
    elif args.abft_on_uncorrectable in (Policy.RECOMPUTE, Policy.SKIP_STEP):
        say_once(
            _log,
            f"[abft] --abft-on-uncorrectable {args.abft_on_uncorrectable}: Megatron-LM's loop "
            "cannot recompute a GEMM or skip a step for ABFT, so an uncorrectable fault raises; "
            "rerun hands it to Megatron's rerun state machine",
            logging.WARNING,
        )


def _refuse(prog: str, problems: list[str]) -> None:
    """Stop the launch: each problem on one line, printed by rank 0 of a torchrun launch only
    (every rank parses the flags), with no usage and no traceback."""
    if os.environ.get("RANK", "0") == "0":
        for problem in problems:
            print(f"{prog}: error: {problem}", file=sys.stderr)
    raise SystemExit(2)


def run_config(args: argparse.Namespace) -> dict:
    """The launch arguments as a W&B run config of JSON values: numbers, booleans, strings,
    lists and mappings stay as they are, faults become their ``--abft-inject`` specs, and
    anything else (dtypes, enums, paths) its string."""

    def plain(value):
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, Fault):
            return fault_spec(value)
        if isinstance(value, (list, tuple)):
            return [plain(item) for item in value]
        if isinstance(value, dict):
            return {str(key): plain(item) for key, item in value.items()}
        return str(value)

    return {name: plain(value) for name, value in vars(args).items()}


def parse_fault_rates(text: str) -> dict[str, float]:
    """``inf=1e-9,nan=1e-9,...`` -> {kind: rate}; kinds as megatron_abft.check.eec.KINDS."""
    rates = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        kind, _, value = item.partition("=")
        if kind not in KINDS:
            raise argparse.ArgumentTypeError(
                f"unknown fault kind {kind!r} in {text!r}; choose from {', '.join(KINDS)}"
            )
        try:
            rate = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"rate of {kind!r} must be a number, got {value!r}"
            ) from None
        if not (rate >= 0 and math.isfinite(rate)):
            raise argparse.ArgumentTypeError(f"rate of {kind!r} must be >= 0, got {value!r}")
        rates[kind] = rate
    if not rates:
        raise argparse.ArgumentTypeError("give at least one KIND=RATE")
    return rates


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not between 0 and 1")
    return value


def coverage_intervals(args: argparse.Namespace) -> dict[str, int | None]:
    """Per-section check intervals (None: off) from ``--abft-coverage-target``: faults land in a
    section in proportion to its GEMM work, cost is the overhead model's for this model shape."""
    vulnerability = dict.fromkeys(FORWARD_SECTIONS, DEFAULT_VULNERABILITY)
    if args.abft_vulnerability:
        measured = json.loads(Path(args.abft_vulnerability).read_text())
        vulnerability.update({s: measured[s] for s in FORWARD_SECTIONS if s in measured})
    shape = ModelShape(
        "this run",
        args.num_layers,
        args.hidden_size,
        args.num_attention_heads,
        args.ffn_hidden_size or 4 * args.hidden_size,
        getattr(args, "padded_vocab_size", None) or 50304,
        seq=args.seq_length,
        micro_batch=args.micro_batch_size,
        tp=args.tensor_model_parallel_size,
        kv_groups=args.num_query_groups if getattr(args, "group_query_attention", True) else None,
        dtype="bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
        block=args.abft_block_size,
        # Megatron-LM's flags name it add_bias_linear, pretrain_gpt's disable_bias_linear
        bias=getattr(args, "add_bias_linear", not getattr(args, "disable_bias_linear", False)),
    )
    forward = baseline_forward(shape)
    exposure = {s: forward[s].flops for s in FORWARD_SECTIONS}
    costs = predict(shape, DEVICES[args.abft_cost_device], "torch").sections
    rates = harm(args.abft_fault_rates, vulnerability, exposure)
    return choose_intervals(rates, costs, args.abft_coverage_target)


def abft_config_from_args(args: argparse.Namespace, enabled: bool | None = None) -> ABFTConfig:
    """The ABFTConfig the ``--abft*`` flags describe (``enabled`` overrides ``--abft``)."""
    sections, interval = args.abft_sections, args.abft_check_interval
    if getattr(args, "abft_coverage_target", None) is not None:
        chosen = coverage_intervals(args)
        sections = tuple(s for s, n in chosen.items() if n)
        if args.abft_coverage_target > 0:  # the model prices the forward checks only
            sections += BACKWARD_SECTIONS
        interval = {s: n for s, n in chosen.items() if n}
    values = {name: getattr(args, config_dest(name)) for name in CONFIG_FLAGS}
    values.update(sections=sections, check_interval=interval, events_file=events_file(args))
    values["enabled"] = bool(args.abft) if enabled is None else enabled
    return ABFTConfig(**values)


def events_file(args: argparse.Namespace) -> str:
    """Where uncorrectable faults are recorded: ``--abft-events-file``, else
    ``<save>/abft_events.jsonl`` with ``--save``, else ``abft_events.jsonl``."""
    if getattr(args, "abft_events_file", None):
        return args.abft_events_file
    if getattr(args, "save", None):
        return os.path.join(args.save, "abft_events.jsonl")
    return ABFTConfig.events_file


def unchecked_note(config: ABFTConfig) -> str | None:
    """What the check intervals above 1 leave unchecked, as one line; None where every section
    is checked every step."""
    sparse = [f"{s} every {config.interval(s)}" for s in config.sections if config.interval(s) > 1]
    if not config.enabled or not sparse:
        return None
    return (
        f"[abft] check intervals above 1 ({', '.join(sparse)} steps): a fault in a step between "
        "two checks of its section is not detected"
    )


def launch_problems(args: argparse.Namespace) -> list[str]:
    """What in the ``--abft*`` flags (and the Megatron flags they depend on) cannot run, one
    message each, for the parser to refuse before any rank trains."""
    problems = FaultPlan.from_args(args).problems()
    vulnerability = getattr(args, "abft_vulnerability", None)
    if vulnerability:
        try:
            json.loads(Path(vulnerability).read_text())
        except (OSError, ValueError) as error:
            problems.append(
                f"--abft-vulnerability {vulnerability}: {error.__class__.__name__}: {error}; give "
                "the JSON file tools/fault_campaign.py writes"
            )
    events = getattr(args, "abft_events_file", None)
    if events:
        folder = Path(events).resolve().parent
        while not folder.exists():
            folder = folder.parent
        if Path(events).is_dir() or not os.access(folder, os.W_OK):
            problems.append(
                f"--abft-events-file {events}: cannot be written (a folder, or {folder} is not "
                "writable); give a file in a writable folder"
            )
    dropout = getattr(args, "attention_dropout", 0.0)
    if args.abft and args.abft_attention == "flash" and dropout:
        problems.append(
            f"--abft-attention flash needs --attention-dropout 0 (it is {dropout}): the flash "
            "kernels have no dropout; or use --abft-attention auto or unfused"
        )
    return problems


def flag_names(parser: argparse.ArgumentParser) -> Iterable[str]:
    """Every long option of ``parser`` (for error messages that suggest a flag)."""
    for action in parser._actions:
        yield from (o for o in action.option_strings if o.startswith("--"))
