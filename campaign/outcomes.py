"""What one run of a fault-campaign trial did: its deviation from the fault-free run, its
summary for the results file, its outcome (``classify``) and the magnitude class of its fault for
the vulnerability file."""

from __future__ import annotations

import math
from collections import Counter

from campaign.plan import CHECKED_SECTION, VULNERABILITY_KINDS


def loss_deviation(losses: list[float], skipped: list[bool], reference: list[float]) -> float:
    """Largest relative difference from the fault-free losses over the steps not skipped."""
    worst = 0.0
    for loss, skip, ref in zip(losses, skipped, reference, strict=True):
        if skip:
            continue
        if not math.isfinite(loss):
            return math.inf
        worst = max(worst, abs(loss - ref) / abs(ref))
    return worst


def summarise(run: dict, trial: dict, tolerance: float, first_step: int) -> dict:
    """What one run of a trial did to training, and (protection on) what ABFT saw."""
    applied = [x for x, skip in zip(run["losses"], run["skipped"], strict=True) if not skip]
    nonfinite_loss = any(not math.isfinite(x) for x in applied)
    out = {
        "landed": run["landed"],
        "losses": [json_number(x) for x in run["losses"]],
        "skipped_steps": sum(run["skipped"]),
        "nonfinite_loss": nonfinite_loss,
        "nonfinite_params": run["nonfinite_params"],
        "non_trainable": nonfinite_loss or run["nonfinite_params"],
        "loss_deviation": json_number(run["loss_deviation"]),
        "param_deviation": json_number(run["param_deviation"]),
    }
    if "counts" in run:
        counts = run["counts"]
        out["detected"] = sum(c["detected"] for c in counts.values())
        out["corrected"] = sum(c["corrected"] for c in counts.values())
        out["uncorrectable"] = sum(c["uncorrectable"] for c in counts.values())
        out["counts"] = {s: c for s, c in counts.items() if any(c.values())}
        out["detected_kinds"] = {s: k for s, k in run["detected_kinds"].items() if k}
        where = Counter(
            f"step {e['step'] - first_step + 1} layer {e['layer']} {e['section']} "
            f"tp{e['tp_rank']} {e['action']}"
            for e in run["events"]
        )
        out["events"] = [f"{n}x {w}" if n > 1 else w for w, n in sorted(where.items())][:12]
        if not trial["control"]:  # checks flagged elsewhere than where the fault landed
            home = (trial["layer"], CHECKED_SECTION[trial["section"]], trial["tp_rank"])
            out["flagged_elsewhere"] = sum(
                1 for e in run["events"] if (e["layer"], e["section"], e["tp_rank"]) != home
            )
    out["outcome"] = classify(out, trial["control"], tolerance)
    return out


OUTCOMES_OFF = ("non_trainable", "deviated", "masked")
OUTCOMES_ON = ("corrected", "reported", "masked", "silent", "miscorrected")
OUTCOMES_CONTROL = ("clean", "false_alarm", "deviated")


def classify(run: dict, control: bool, tolerance: float) -> str:
    """What a fault did in one run.

    Protection off: ``non_trainable``; ``deviated`` (the loss or the parameters moved by more
    than ``tolerance``, relative); ``masked`` (no effect). Protection on: ``corrected`` (detected,
    every detection corrected, no effect left); ``reported`` (counted uncorrectable, so the
    policy acted); ``masked`` (not detected and no effect: below the detection limit, or
    harmless); ``silent`` (not detected, yet training changed); ``miscorrected`` (corrected,
    yet training changed). Clean controls: ``clean``, ``false_alarm`` or ``deviated``."""
    effect = run["non_trainable"] or not (
        read_number(run["loss_deviation"]) <= tolerance
        and read_number(run["param_deviation"]) <= tolerance
    )
    if "detected" not in run:
        return "non_trainable" if run["non_trainable"] else "deviated" if effect else "masked"
    if control:
        return "false_alarm" if run["detected"] else "deviated" if effect else "clean"
    if not run["detected"]:
        return "silent" if effect else "masked"
    if run["uncorrectable"]:
        return "reported"
    return "miscorrected" if effect else "corrected"


def magnitude_class(trial: dict, on: dict) -> str:
    """The eec.KINDS class of a fault, for the vulnerability file: -inf counts as inf, a finite
    value below near-INF (1e10) as finite; a bitflip as what the checks measured in its section
    (the worst kind detected), finite when too small to be detected."""
    kind = trial["kind"]
    if kind in ("inf", "-inf"):
        return "inf"
    if kind in ("nan", "near_inf"):
        return kind
    if kind.startswith("value_"):
        return "near_inf" if abs(trial["value"]) >= 1e10 else "finite"
    seen = on.get("detected_kinds", {}).get(CHECKED_SECTION[trial["section"]], [])
    return max(seen, key=VULNERABILITY_KINDS.index) if seen else "finite"


def json_number(x: float) -> float | str:
    """A float for JSON: non-finite values as strings, as the telemetry writes them."""
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return float(f"{x:.9g}")


def read_number(x: float | str) -> float:
    return float(x)  # float("nan") and float("inf") read the strings back
