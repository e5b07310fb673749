"""The check-frequency optimizer: how often to check each section (ATTNChecker's Algorithm 1).

A fault of kind t lands in section s at a rate ``rate[t] * exposure[s]`` and makes training
non-trainable with probability ``vulnerability[s][t]``; its harm rate is
``harm[s] = exposure[s] * sum_t rate[t] * vulnerability[s][t]``. Checking s every n-th step
catches 1/n of its faults at 1/n of its cost ``cost[s]`` (the fraction of step time one check of
every layer takes). Coverage is the caught share of all harm. The optimizer picks per-section
intervals from a menu (or "off") that reach a target coverage at least cost.

The greedy is Algorithm 1: sections in order of coverage per unit of cost, each checked every
step until the target is within reach, the last one at the longest interval that still reaches
it. It solves the continuous relaxation exactly, so its cost exceeds the true optimum by at most
one section's cost; tests/tuning/test_frequency.py compares it with brute force.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping

INTERVALS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
"""The intervals a section may be checked at; a section can also be left off (None)."""

DEFAULT_VULNERABILITY: dict[str, float] = {"inf": 1.0, "nan": 1.0, "near_inf": 0.5, "finite": 0.01}
"""Chance that one fault of each kind makes training non-trainable, the same in every section,
until the fault campaign (tools/fault_campaign.py) measures it per section."""


def harm(
    rates: Mapping[str, float],
    vulnerability: Mapping[str, Mapping[str, float]],
    exposure: Mapping[str, float],
) -> dict[str, float]:
    """Harmful-fault rate of each section."""
    for kind, rate in rates.items():
        if not (rate >= 0 and math.isfinite(rate)):
            raise ValueError(f"fault rate of {kind!r} is {rate!r}; use a finite number >= 0")
    return {
        s: exposure[s] * sum(r * vulnerability[s].get(k, 0.0) for k, r in rates.items())
        for s in exposure
    }


def coverage(harm_rate: Mapping[str, float], intervals: Mapping[str, int | None]) -> float:
    total = sum(harm_rate.values())
    if total == 0:
        return 1.0
    caught = sum(h / intervals[s] for s, h in harm_rate.items() if intervals.get(s))
    return caught / total


def cost(costs: Mapping[str, float], intervals: Mapping[str, int | None]) -> float:
    return sum(c / intervals[s] for s, c in costs.items() if intervals.get(s))


def choose_intervals(
    harm_rate: Mapping[str, float],
    costs: Mapping[str, float],
    target: float,
    menu: tuple[int, ...] = INTERVALS,
) -> dict[str, int | None]:
    """Algorithm 1: per-section intervals (None = off) reaching ``target`` coverage cheaply."""
    if not 0 <= target <= 1:
        raise ValueError(f"coverage target {target!r}: use a number between 0 and 1")
    for section, c in costs.items():
        if not (c > 0 and math.isfinite(c)):
            raise ValueError(f"cost of section {section!r} is {c!r}; use a positive number")
    intervals: dict[str, int | None] = dict.fromkeys(harm_rate)
    order = sorted(harm_rate, key=lambda s: harm_rate[s] / costs[s], reverse=True)
    for section in order:
        if coverage(harm_rate, intervals) >= target:
            break
        for n in sorted(menu, reverse=True):  # the cheapest interval that reaches the target
            intervals[section] = n
            if coverage(harm_rate, intervals) >= target:
                break
        else:
            intervals[section] = min(menu)
    return intervals


def brute_force(
    harm_rate: Mapping[str, float],
    costs: Mapping[str, float],
    target: float,
    menu: tuple[int, ...] = INTERVALS,
) -> dict[str, int | None]:
    """The cheapest intervals reaching ``target``, by trying every combination (small cases)."""
    sections = list(harm_rate)
    best, best_cost = None, math.inf
    for choice in itertools.product((None, *menu), repeat=len(sections)):
        intervals = dict(zip(sections, choice, strict=True))
        if coverage(harm_rate, intervals) >= target and cost(costs, intervals) < best_cost:
            best, best_cost = intervals, cost(costs, intervals)
    if best is None:
        raise ValueError(f"no intervals from {menu} reach coverage {target}")
    return best
