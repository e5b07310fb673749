import random

import pytest

from megatron_abft.tuning.frequency import (
    DEFAULT_VULNERABILITY,
    INTERVALS,
    brute_force,
    choose_intervals,
    cost,
    coverage,
    harm,
)

SECTIONS = ("qkv", "scores", "context", "proj")


def random_case(rng: random.Random, sections=SECTIONS):
    harm_rate = {s: rng.choice([0.0, rng.uniform(0.01, 1), rng.uniform(1, 10)]) for s in sections}
    costs = {s: rng.uniform(0.001, 0.05) for s in sections}
    return harm_rate, costs, rng.choice([0.5, 0.9, 0.99, 0.999, 1.0])


def test_greedy_reaches_the_target_within_one_section_of_the_optimum():
    """Brute force over every combination of intervals and "off" for 3 and 4 sections."""
    rng = random.Random(0)
    exact = 0
    cases = 300
    for i in range(cases):
        harm_rate, costs, target = random_case(rng, SECTIONS[: 3 + i % 2])
        menu = INTERVALS[:4]
        greedy = choose_intervals(harm_rate, costs, target, menu)
        best = brute_force(harm_rate, costs, target, menu)
        assert coverage(harm_rate, greedy) >= target
        assert cost(costs, greedy) <= cost(costs, best) + max(costs.values()) + 1e-12
        exact += cost(costs, greedy) <= cost(costs, best) * (1 + 1e-9)
    assert exact >= 0.6 * cases  # it is the optimum most of the time


def test_a_section_nobody_can_hurt_is_never_checked_and_full_coverage_checks_every_step():
    harm_rate = {"qkv": 1.0, "scores": 0.0, "context": 2.0, "proj": 0.5}
    costs = dict.fromkeys(SECTIONS, 0.01)
    full = choose_intervals(harm_rate, costs, 1.0)
    assert full == {"qkv": 1, "scores": None, "context": 1, "proj": 1}
    assert choose_intervals(harm_rate, costs, 0.0) == dict.fromkeys(SECTIONS)


def test_the_most_efficient_section_is_checked_first():
    harm_rate = dict.fromkeys(SECTIONS, 1.0)
    costs = {"qkv": 0.04, "scores": 0.01, "context": 0.02, "proj": 0.03}
    chosen = choose_intervals(harm_rate, costs, 0.25)
    assert chosen == {"qkv": None, "scores": 1, "context": None, "proj": None}
    chosen = choose_intervals(harm_rate, costs, 0.3)  # scores every step, context 1 in 4
    assert chosen["scores"] == 1 and chosen["context"] == 4


def test_harm_weights_rates_by_vulnerability_and_exposure():
    vulnerability = dict.fromkeys(SECTIONS, DEFAULT_VULNERABILITY)
    exposure = {"qkv": 0.4, "scores": 0.2, "context": 0.2, "proj": 0.2}
    rates = {"nan": 1e-3, "finite": 1e-1}
    h = harm(rates, vulnerability, exposure)
    assert h["qkv"] == pytest.approx(0.4 * (1e-3 * 1.0 + 1e-1 * 0.01))
    with pytest.raises(ValueError, match="fault rate of 'nan'"):
        harm({"nan": -1.0}, vulnerability, exposure)


def test_bad_targets_and_costs_are_refused():
    harm_rate = dict.fromkeys(SECTIONS, 1.0)
    with pytest.raises(ValueError, match="coverage target"):
        choose_intervals(harm_rate, dict.fromkeys(SECTIONS, 0.1), 1.5)
    with pytest.raises(ValueError, match="cost of section 'qkv'"):
        choose_intervals(harm_rate, {**dict.fromkeys(SECTIONS, 0.1), "qkv": 0.0}, 0.5)
