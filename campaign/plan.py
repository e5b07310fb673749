"""The fault campaign's plan: its settings, where its files live, the fault space (sections,
kinds, patterns), the seeded list of trials and the megatron_abft Fault of each, and the reading
of a results file (a JSONL of a campaign header, trial records and session records)."""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

from megatron_abft.config import BACKWARD_SECTIONS, FORWARD_SECTIONS
from megatron_abft.config import KINDS as ABFT_KINDS
from megatron_abft.faults import MODEL_SECTIONS

ROOT = Path(__file__).resolve().parent.parent

CONFIG = ROOT / "configs" / "tiny_cpu.yaml"
CORPUS = ROOT / "out" / "fault_campaign" / "corpus" / "tiny_corpus"
LOGS = ROOT / "out" / "fault_campaign" / "logs"
DEFAULT_DOC = ROOT / "docs" / "fault-campaign.md"
DOCS = {
    "results": ROOT / "docs" / "figures" / "campaign_trials.jsonl",
    "doc": DEFAULT_DOC,
    "figure": ROOT / "docs" / "figures" / "campaign.png",
    "vulnerability": ROOT / "docs" / "figures" / "vulnerability.json",
    "summary": ROOT / "docs" / "figures" / "campaign_summary.json",
}
"""The campaign's files where the docs keep them (``--update-docs``)."""
OUT = {
    "results": ROOT / "out" / "fault_campaign" / "campaign_trials.jsonl",
    "doc": ROOT / "out" / "fault_campaign" / "fault-campaign.md",
    "figure": ROOT / "out" / "fault_campaign" / "campaign.png",
    "vulnerability": ROOT / "out" / "fault_campaign" / "vulnerability.json",
    "summary": ROOT / "out" / "fault_campaign" / "campaign_summary.json",
}
"""The campaign's files otherwise: out/ holds what a run makes, docs/ what was published."""

SECTIONS = tuple(s for s in MODEL_SECTIONS if s not in BACKWARD_SECTIONS)
"""The fault sections of the unfused attention (megatron_abft.faults.MODEL_SECTIONS), in the
order the tables use."""
PROTECTED = ("qkv", "q", "k", "v", "scores", "context", "proj")
"""Sections whose faults the checks cover; probs, the softmax output, is the blind spot."""
CHECKED_SECTION = {s: "qkv" if s in ("q", "k", "v") else s for s in SECTIONS}
CHECKED_SECTION["probs"] = "context"  # a fault in P lands in the context GEMM's input
KINDS = ("inf", "-inf", "nan", "near_inf", "bitflip", "value_1e1", "value_1e4", "value_1e8")
"""Campaign kinds: the fault kinds of megatron_abft.faults, with finite values at 3 magnitudes."""
PATTERNS = ("0d", "row", "col", "2d")
CORRECTABLE_PATTERNS = ("0d", "row", "col")
VULNERABILITY_SECTIONS = FORWARD_SECTIONS  # the sections the unfused attention checks
VULNERABILITY_KINDS = ABFT_KINDS  # by a fault's worst checksum difference
POLICIES = ("skip_step", "log")


@dataclass(frozen=True)
class Settings:
    """What makes a campaign: a results file is resumed only with the same settings."""

    trials: int
    controls: int
    window: int
    windows: int
    warmup: int
    seed: int
    policy: str
    tolerance: float
    sections: tuple[str, ...]
    kinds: tuple[str, ...]
    patterns: tuple[str, ...]
    launch_flags: tuple[str, ...]

    def as_json(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items()}


def plan(settings: Settings, num_layers: int, tp_size: int, dtype_bits: int) -> list[dict]:
    """Every trial of the campaign, from the seed alone. Faulty trials cycle through every
    section x kind x pattern in a shuffled order (a full pass before any repeats), each with a
    random step of the window, layer, TP rank, data window and position; ``controls`` clean
    trials are spread evenly among them."""
    rng = random.Random(settings.seed)
    combos = [
        (s, k, p) for s in settings.sections for k in settings.kinds for p in settings.patterns
    ]
    faulty = settings.trials - settings.controls
    chosen: list[tuple[str, str, str]] = []
    while len(chosen) < faulty:
        batch = combos[:]
        rng.shuffle(batch)
        chosen += batch
    chosen = chosen[:faulty]
    spacing = settings.trials / settings.controls if settings.controls else 0
    control_ids = {round((i + 0.5) * spacing) for i in range(settings.controls)}
    if settings.controls == settings.trials:  # spacing 1: rounding half to even would collide
        control_ids = set(range(settings.trials))
    trials, picks = [], iter(chosen)
    for trial_id in range(settings.trials):
        trial: dict = {
            "id": trial_id,
            "window": rng.randrange(settings.windows),
            "control": trial_id in control_ids,
        }
        if not trial["control"]:
            section, kind, pattern = next(picks)
            trial.update(
                section=section,
                kind=kind,
                pattern=pattern,
                step=rng.randint(1, settings.window),
                layer=rng.randint(1, num_layers),
                tp_rank=rng.randrange(tp_size),
                seed=rng.randrange(2**31),
            )
            sign = rng.choice((-1.0, 1.0))
            if kind.startswith("value_"):
                trial["value"] = sign * float(kind.split("_")[1])
            elif kind == "bitflip":
                trial["bit"] = rng.randrange(dtype_bits)
        trials.append(trial)
    return trials


def fault_of(trial: dict, iteration: int):
    """The megatron_abft Fault of a trial, landing at training iteration ``iteration``."""
    from megatron_abft import Fault

    kind = trial["kind"]
    extra = {}
    if kind.startswith("value_"):
        kind, extra = "value", {"value": trial["value"]}
    elif kind == "bitflip":
        extra = {"bit": trial["bit"]}
    return Fault(
        trial["section"],
        kind,
        trial["pattern"],
        layer=trial["layer"],
        tp_rank=trial["tp_rank"],
        step=iteration,
        seed=trial["seed"],
        **extra,
    )


def settings_from_json(data: dict) -> Settings:
    return Settings(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


def read_results(path: Path) -> tuple[dict | None, list[dict], list[dict]]:
    """(campaign settings, trial records, session records) of a results file."""
    header, trials, sessions = None, [], []
    if not path.exists():
        return header, trials, sessions
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            # a line cut short by a kill: the trial is simply run again
            print(f"{path}:{number}: skipping an incomplete line", file=sys.stderr)
            continue
        if "campaign" in record:
            header = record["campaign"]
        elif "session" in record:
            sessions.append(record["session"])
        else:
            trials.append(record)
    return header, trials, sessions


def rel(path: Path) -> str:
    """A path as the reports quote it: relative to the repository when it lies inside."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)
