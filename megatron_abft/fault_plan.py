"""Faults from the command line, step by step: ``--abft-inject`` specs read and written
(``parse_fault``, ``fault_spec``), and the FaultPlan a run lands at its steps, the explicit faults
and one seeded random fault every few steps, checked against the model before any rank trains.
Importing this module does not import Megatron."""

from __future__ import annotations

import argparse
import random
from collections.abc import Iterable
from dataclasses import dataclass, field

from megatron_abft.config import BACKWARD_SECTIONS
from megatron_abft.faults import FAULT_KINDS, MODEL_SECTIONS, Fault

STREAM_SECTIONS: tuple[str, ...] = ("qkv", "q", "k", "v", "scores", "context", "proj")
"""Where ``--abft-inject-every`` lands faults by default: every fault section but ``probs``, the
softmax output, which GEMM checksums cannot cover (docs/megatron.md)."""

MATRIX_SECTIONS = frozenset({"scores", "probs", "context"})
"""Sections whose checked matrices are checked on both sides per head: 1D faults (a whole row or
column) are correctable there. The linear layers' outputs take 0D faults."""

FAULT_KEYS: dict[str, str] = {
    "section": "section",
    "kind": "kind",
    "pattern": "pattern",
    "layer": "layer",
    "step": "step",
    "tp-rank": "tp_rank",
    "value": "value",
    "bit": "bit",
    "seed": "seed",
    "block": "block",
    "persistent": "persistent",
}
"""The keys of an ``--abft-inject`` spec and the ``Fault`` fields they set."""


def parse_fault(text: str) -> Fault:
    """A fault from its command-line spec: ``section=scores,layer=1,kind=inf,step=20,tp-rank=1``.
    Keys: section (required), kind, pattern, layer (1-based), step (required), tp-rank, value,
    bit, seed, block (rows x columns of a 2d block: ``block=64x64``), persistent (``yes``: in
    every computation of its call, the flash kernels' second pass included)."""
    fields: dict[str, object] = {}
    for item in (part.strip() for part in text.split(",")):
        key, sep, value = item.partition("=")
        key = key.strip().replace("_", "-")
        if not sep or key not in FAULT_KEYS:
            raise argparse.ArgumentTypeError(
                f"{text!r}: {item!r} is not a key=value pair with a known key; use "
                f"{', '.join(FAULT_KEYS)} (e.g. section=scores,layer=1,kind=inf,step=20)"
            )
        name = FAULT_KEYS[key]
        try:
            if name in ("layer", "step", "tp_rank", "bit", "seed"):
                fields[name] = int(value)
            elif name == "value":
                fields[name] = float(value)
            elif name == "block":
                fields[name] = tuple(int(size) for size in value.split("x"))
            elif name == "persistent":
                fields[name] = {"yes": True, "no": False}[value.strip()]
            else:
                fields[name] = value.strip()
        except (ValueError, KeyError):
            expected = {"block": "rows x columns such as 4x4", "persistent": "yes or no"}.get(
                name, "a number"
            )
            raise argparse.ArgumentTypeError(
                f"{text!r}: {key}={value!r} is not {expected}"
            ) from None
    for required in ("section", "step"):
        if required not in fields:
            raise argparse.ArgumentTypeError(
                f"{text!r}: {required}= is missing (e.g. section=scores,layer=1,kind=inf,step=20)"
            )
    if fields.get("kind") == "value" and "value" not in fields:
        fields["value"] = 1e4
    try:
        return Fault(**fields)  # type: ignore[arg-type]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r}: {error}") from None


def parse_inject_sections(text: str) -> tuple[str, ...]:
    """``scores,context`` -> the sections random faults land in (``--abft-inject-sections``)."""
    chosen = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [s for s in chosen if s not in MODEL_SECTIONS]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(
            f"{text!r}: unknown section {unknown[0] if unknown else ''!r}; "
            f"choose from {', '.join(MODEL_SECTIONS)}"
        )
    return chosen


def fault_spec(fault: Fault) -> str:
    """``fault`` as the ``--abft-inject`` spec parse_fault reads back: its section, kind and
    step, and the keys that differ from a Fault's defaults."""
    default = Fault(section=fault.section, step=fault.step)
    items = []
    for key, name in FAULT_KEYS.items():
        value = getattr(fault, name)
        if name in ("section", "kind", "step") or value != getattr(default, name):
            if name == "block":
                value = "x".join(str(size) for size in value)
            elif name == "persistent":
                value = "yes" if value else "no"
            items.append(f"{key}={value}")
    return ",".join(items)


def known_attention(args: argparse.Namespace) -> str | None:
    """The core attention ``--abft-attention`` will build, where the flags settle it: flash or
    unfused as named, and ``auto`` without a GPU for the kernels or with attention dropout
    (megatron_abft.spec.AutoProtectedAttention); None where only the build can tell."""
    attention = getattr(args, "abft_attention", "auto")
    if attention != "auto":
        return attention
    from megatron_abft.layers.flash_attention import kernels_compile_here

    if not kernels_compile_here() or getattr(args, "attention_dropout", 0.0):
        return "unfused"
    return None


@dataclass
class FaultPlan:
    """The faults to inject at each step: the explicit ones (``--abft-inject``) and, every
    ``every`` steps, one random fault drawn from ``seed`` and the step alone (so a resumed run
    injects the same faults at the same steps)."""

    explicit: list[Fault] = field(default_factory=list)
    every: int = 0
    sections: tuple[str, ...] = STREAM_SECTIONS
    num_layers: int = 1
    tp_size: int = 1
    num_query_groups: int | None = None
    """KV groups of the model; with fewer groups than TP ranks, k and v are left out."""
    seed: int = 0
    exponent_bit: int = 30
    """The bit a random bitflip flips: the top exponent bit of the data type (30 for fp32, 14
    for bf16 and fp16), so that the fault is large enough to matter."""
    train_iters: int | None = None
    """The run's last iteration (the first is 1); None: unknown, steps are not checked."""
    seq_length: int | None = None
    """With the fields below, the model's shape, to check that a fault's block fits the
    matrix it lands in; None: unknown, blocks are checked when they land."""
    micro_batch_size: int = 1
    hidden_size: int = 0
    num_heads: int = 1
    head_dim: int | None = None
    attention: str | None = None
    """The core attention the model will build, "flash" or "unfused", to check that the faults'
    sections exist in it; None: not known before the build (``auto`` on a GPU), sections are
    checked when they land."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> FaultPlan:
        bf16, fp16 = getattr(args, "bf16", False), getattr(args, "fp16", False)
        return cls(
            attention=known_attention(args),
            explicit=list(args.abft_inject or []),
            every=args.abft_inject_every,
            sections=tuple(args.abft_inject_sections),
            num_layers=args.num_layers,
            tp_size=args.tensor_model_parallel_size,
            num_query_groups=getattr(args, "num_query_groups", None),
            seed=args.abft_inject_seed if args.abft_inject_seed is not None else args.seed,
            exponent_bit=14 if (bf16 or fp16) else 30,
            train_iters=getattr(args, "train_iters", None),
            seq_length=getattr(args, "seq_length", None),
            micro_batch_size=getattr(args, "micro_batch_size", 1) or 1,
            hidden_size=getattr(args, "hidden_size", 0) or 0,
            num_heads=getattr(args, "num_attention_heads", 1) or 1,
            head_dim=getattr(args, "kv_channels", None),
        )

    @property
    def active(self) -> bool:
        return bool(self.explicit) or self.every > 0

    def problems(self) -> list[str]:
        """What makes this plan impossible for the model, as messages naming the fix."""
        found = []
        for fault in self.explicit:
            if fault.layer is not None and not 1 <= fault.layer <= self.num_layers:
                found.append(
                    f"--abft-inject: layer={fault.layer} is not a layer of this model; use "
                    f"1..{self.num_layers} (Megatron's layer numbers start at 1)"
                )
            if fault.tp_rank is not None and not 0 <= fault.tp_rank < self.tp_size:
                found.append(
                    f"--abft-inject: tp-rank={fault.tp_rank} does not exist with "
                    f"--tensor-model-parallel-size {self.tp_size}; use 0..{self.tp_size - 1}"
                )
            if fault.step is not None and self.train_iters is not None:
                if not 1 <= fault.step <= self.train_iters:
                    found.append(
                        f"--abft-inject: step={fault.step} is outside the run; use "
                        f"1..{self.train_iters} (--train-iters {self.train_iters})"
                    )
            bits = 16 if self.exponent_bit == 14 else 32
            if fault.bit is not None and fault.bit >= bits:
                found.append(
                    f"--abft-inject: bit={fault.bit} is not a bit of a {bits}-bit value; use "
                    f"0..{bits - 1}"
                )
            found.extend(self._section_problems("--abft-inject", (fault.section,)))
            matrix = self.matrix(fault.section)
            if fault.block is not None and matrix is not None:
                (h, w), (m, n) = fault.block, matrix
                if h > m or w > n:
                    found.append(
                        f"--abft-inject: block={h}x{w} does not fit section {fault.section}'s "
                        f"{m}x{n} matrix on a rank"
                    )
        if self.every:
            found.extend(self._section_problems("--abft-inject-sections", self.sections))
        return list(dict.fromkeys(found))  # one message per problem, however many faults

    def _section_problems(self, flag: str, sections: Iterable[str]) -> list[str]:
        if self.attention is None:
            return []
        missing = ("probs",) if self.attention == "flash" else BACKWARD_SECTIONS
        have = [s for s in MODEL_SECTIONS if s not in missing]
        return [
            f"{flag}: section={section} is not in the {self.attention} attention this run "
            f"builds; use {', '.join(have)}, or --abft-attention "
            f"{'unfused' if self.attention == 'flash' else 'flash'}"
            for section in sections
            if section in missing
        ]

    def matrix(self, section: str) -> tuple[int, int] | None:
        """Rows and columns of the matrix a fault in ``section`` lands in, on one rank (per
        head for the attention's matrices); None where the shape is unknown."""
        if self.seq_length is None or not self.hidden_size:
            return None
        n, tokens = self.seq_length, self.seq_length * self.micro_batch_size
        d = self.head_dim or self.hidden_size // self.num_heads
        heads = max(1, self.num_heads // self.tp_size)
        groups = max(1, (self.num_query_groups or self.num_heads) // self.tp_size)
        square = dict.fromkeys(("scores", "probs", "bwd_scores", "grad_probs"), (n, n))
        tall = dict.fromkeys(("context", "grad_v", "grad_k", "grad_q"), (n, d))
        return {
            **square,
            **tall,
            "qkv": (tokens, (heads + 2 * groups) * d),
            "q": (tokens, heads * d),
            "k": (tokens, groups * d),
            "v": (tokens, groups * d),
            "proj": (tokens, self.hidden_size),
        }.get(section)

    def at(self, step: int) -> list[Fault]:
        """The faults due at training step ``step``."""
        faults = [f for f in self.explicit if f.step == step]
        if self.every and step % self.every == 0:
            faults.append(self.random_fault(step))
        return faults

    def random_fault(self, step: int) -> Fault:
        rng = random.Random(self.seed * 1_000_003 + step)
        sections = [s for s in self.sections if s not in ("k", "v") or self._kv_on_every_rank]
        section = rng.choice(sections)
        kind = rng.choice(FAULT_KINDS)
        pattern = rng.choice(("0d", "row", "col")) if section in MATRIX_SECTIONS else "0d"
        extra: dict[str, float | int] = {}
        if kind == "value":
            extra["value"] = rng.choice((-1.0, 1.0)) * 1e4
        elif kind == "bitflip":
            extra["bit"] = self.exponent_bit
        return Fault(
            section,
            kind,
            pattern,
            layer=rng.randint(1, self.num_layers),
            tp_rank=rng.randrange(self.tp_size),
            step=step,
            seed=rng.randrange(2**31),
            **extra,
        )

    @property
    def _kv_on_every_rank(self) -> bool:
        return self.num_query_groups is None or self.num_query_groups >= self.tp_size
