"""tools/flash_tune.py keeps the gate's tiles unless a candidate wins by more than the timings'
spread: the sweep's single timings were noise (docs/benchmarks.md, "The tile sweep")."""

from bench.flash_tune import MARGIN, choose
from megatron_abft.flash.tiles import Blocks

GATE, SMALL, WIDE = Blocks(128, 128, 8, 2), Blocks(64, 64, 4, 2), Blocks(128, 64, 8, 2)


def test_a_candidate_whose_rounds_overlap_the_gates_does_not_replace_it():
    """The run on an H200 timed the gate's tiles 2.64 and 2.21 ms: a candidate at 2.23 with
    the same spread is no win."""
    samples = {GATE: [2.64, 2.21, 2.40], SMALL: [2.23, 2.60, 2.30]}
    assert choose(samples, GATE) == GATE


def test_a_candidate_faster_in_every_round_by_the_margin_replaces_it():
    samples = {GATE: [2.64, 2.50, 2.55], SMALL: [2.30, 2.35, 2.40], WIDE: [2.10, 2.20, 2.48]}
    assert choose(samples, GATE) == SMALL  # WIDE's median is lower, but its slowest round is not
    samples[WIDE] = [2.10, 2.20, 2.40]  # now clear of the gate's fastest too: the lower median
    assert choose(samples, GATE) == WIDE


def test_the_margin_is_a_fraction_of_the_gates_fastest_round():
    fastest = 2.0
    just_short = fastest * (1 - MARGIN) * 1.001
    assert choose({GATE: [fastest, 3.0], SMALL: [just_short] * 3}, GATE) == GATE
    assert choose({GATE: [fastest, 3.0], SMALL: [just_short * 0.99] * 3}, GATE) == SMALL


def test_without_the_gates_timings_the_fastest_median_and_without_any_the_gates():
    assert choose({GATE: [], SMALL: [2.0, 2.5, 2.1], WIDE: [2.2, 2.2, 2.2]}, GATE) == SMALL
    assert choose({GATE: [], SMALL: []}, GATE) == GATE
