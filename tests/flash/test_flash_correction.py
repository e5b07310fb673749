"""Faults landed inside the flash kernels are corrected or reported: every section x kind x
pattern. A transient fault gives the clean run's output and gradients, bit for bit, and one
detection and one correction in its section, nothing elsewhere; a persistent one is counted
uncorrectable in its section. Triton's interpreter, one (batch, head). The whole matrix runs at
small tiles (SMALL), so that at 80 tokens every section's matrix spans several tiles both ways;
a case of every section and kind runs again at the production tiles (tiles.TILES), over 300
tokens. One element's faults run with every section checked (what a fault upsets downstream
counts once, where it began); the wider patterns with their own sections alone, which halves
their time in the interpreter. A transient fault's call carries a fault in each pass where it
can (flash_cases.CALLS), five calls for the seven sections."""

import pytest
import torch
from flash_cases import CALLS, inputs, run

from megatron_abft.config import FLASH_SECTIONS
from megatron_abft.faults import FAULT_KINDS, TensorFault
from megatron_abft.flash import FlashFault, tiles
from megatron_abft.flash.faults import first_computations

SEQ, DIM, DTYPE = 80, 64, torch.bfloat16
ROW = 64  # a tile's first row for the small tiles (32, 64)
SMALL = {
    ("forward", 64): tiles.Blocks(64, 32, 4, 1),
    ("dkdv", 64): tiles.Blocks(32, 64, 4, 1),
    ("dq", 64): tiles.Blocks(64, 32, 4, 1),
}
PATTERNS = {
    "0d": dict(pattern="0d", position=(70, 5)),
    "row in a tile": dict(pattern="row", position=(ROW, 0), block=(1, 8)),
    "col in a tile": dict(pattern="col", position=(ROW, 0), block=(8, 1)),
    "2d in a tile": dict(pattern="2d", position=(ROW, 0), block=(3, 4)),
    "row across every tile": dict(pattern="row", position=(70, 0)),
}
LONG = 300
"""The production tiles' case: the last query block (256 on) meets two interior key tiles."""
LONG_PATTERNS = {"0d": dict(pattern="0d", position=(270, 40))}


@pytest.fixture(scope="module")
def small_case():
    return _case(SEQ, SMALL)


@pytest.fixture
def case(small_case, monkeypatch):
    """Inputs, the clean run, and the first computation of each section's matrix in float64
    (for kind 'value': a finite error of one RMS of its neighbourhood), at the small tiles,
    which the test runs at too."""
    monkeypatch.setattr(tiles, "TILES", {**tiles.TILES, **SMALL})
    return small_case


@pytest.fixture(scope="module")
def long_case():
    """As ``case``, at the production tiles over LONG tokens."""
    return _case(LONG, {})


def _case(seq, extra):
    q, k, v, do = inputs(1, 1, 1, seq, DIM, DTYPE, seed=11)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tiles, "TILES", {**tiles.TILES, **extra})
        clean, ledger = run(q, k, v, do)
    assert ledger.counts.sum() == 0
    return q, k, v, do, clean, first_computations(q, k, v, do)


def fault(section, kind, where, matrices, persistent=False, patterns=PATTERNS):
    options = dict(patterns[where])
    if kind == "value":
        r, c = options["position"]
        m = matrices[section]
        around = m[max(r - 16, 0) : r + 16, max(c - 16, 0) : c + 16]
        options["value"] = (m[r, c] + around.pow(2).mean().sqrt()).item()
    return FlashFault(section, TensorFault(kind, bit=30, seed=3, **options), persistent)


def outcomes(ledger, section):
    return {o: sum(k.values()) for o, k in ledger.summary()[section].items()}


def named(cases):
    return ["+".join(c) for c in cases]


def counted_once(ledger, sections):
    """Each of ``sections`` found one fault and corrected it, and nothing else was counted."""
    want = {"detected": 1, "corrected": 1, "uncorrectable": 0}
    assert all(outcomes(ledger, s) == want for s in sections), ledger.summary()
    assert ledger.counts.sum() == 2 * len(sections), ledger.summary()


@pytest.mark.parametrize("where", list(PATTERNS))
@pytest.mark.parametrize("kind", FAULT_KINDS)
@pytest.mark.parametrize("sections", CALLS, ids=named(CALLS))
def test_a_transient_fault_is_corrected_bit_for_bit_and_counted_once(case, sections, kind, where):
    q, k, v, do, clean, matrices = case
    due = FLASH_SECTIONS if where == "0d" else sections
    faults = [fault(s, kind, where, matrices) for s in sections]
    got, ledger = run(q, k, v, do, sections=due, faults=faults)
    assert all(torch.equal(a, b) for a, b in zip(got, clean, strict=True))
    counted_once(ledger, sections)  # nothing in another section


@pytest.mark.parametrize("kind", ["nan", "value"])
@pytest.mark.parametrize("section", FLASH_SECTIONS)
def test_a_persistent_fault_is_counted_uncorrectable(case, section, kind):
    """The second launch flags it again, whatever the kind: an extreme one and a finite one.
    One fault a call: what a forward one leaves wrong, the backward finds again."""
    q, k, v, do, _, matrices = case
    _, ledger = run(q, k, v, do, faults=[fault(section, kind, "0d", matrices, persistent=True)])
    assert outcomes(ledger, section) == {"detected": 1, "corrected": 0, "uncorrectable": 1}
    record = ledger.section(section)
    assert int(record.logged) == 1
    status, matrix = record.log[0, 1:3].tolist()
    assert (status, matrix) == (2.0, 0.0)  # uncorrectable, in matrix 0


def test_a_forward_and_a_backward_fault_land_in_one_call(case):
    q, k, v, do, clean, matrices = case
    faults = [fault("context", "nan", "0d", matrices), fault("grad_k", "inf", "0d", matrices)]
    got, ledger = run(q, k, v, do, faults=faults)
    assert all(torch.equal(a, b) for a, b in zip(got, clean, strict=True))
    assert outcomes(ledger, "context")["corrected"] == outcomes(ledger, "grad_k")["corrected"] == 1
    with pytest.raises(ValueError, match="at most one forward and one backward"):
        run(q, k, v, do, faults=faults[:1] * 2)


@pytest.mark.parametrize("kind", ["nan", "value"])
@pytest.mark.parametrize("sections", CALLS, ids=named(CALLS))
def test_at_the_production_tiles_a_transient_fault_is_corrected(long_case, sections, kind):
    """The tiles the GPUs run (their unmasked interior loops included), in the interpreter."""
    q, k, v, do, clean, matrices = long_case
    faults = [fault(s, kind, "0d", matrices, patterns=LONG_PATTERNS) for s in sections]
    got, ledger = run(q, k, v, do, faults=faults)
    assert all(torch.equal(a, b) for a, b in zip(got, clean, strict=True))
    counted_once(ledger, sections)


def test_a_fault_in_another_head_leaves_this_one_alone():
    """GQA: the fault lands in matrix 3 (batch 1, head 1 of 2); the counters name it."""
    q, k, v, do = inputs(2, 2, 1, 40, DIM, DTYPE, seed=5)
    clean, _ = run(q, k, v, do)
    bad = FlashFault("grad_v", TensorFault("nan", position=(3, 3), batch_index=3))
    got, ledger = run(q, k, v, do, faults=[bad])
    assert all(torch.equal(a, b) for a, b in zip(got, clean, strict=True))
    assert ledger.section("grad_v").log[0, 2].item() == 3.0


def test_only_the_due_sections_are_checked(case):
    """A call checks the sections it is given: a finite fault in another lands unseen (the
    kernel whose sections are none of them runs unchecked; the checked ones downstream take
    its result as their input), one in a given section is corrected."""
    q, k, v, do, clean, matrices = case
    only = ("grad_q",)
    wrong = [fault("scores", "value", "0d", matrices)]
    unseen, ledger = run(q, k, v, do, sections=only, faults=wrong)
    assert ledger.counts.sum() == 0 and not torch.equal(unseen[0], clean[0])
    seen, ledger = run(q, k, v, do, sections=only, faults=[fault("grad_q", "inf", "0d", matrices)])
    assert all(torch.equal(a, b) for a, b in zip(seen, clean, strict=True))
    assert outcomes(ledger, "grad_q") == {"detected": 1, "corrected": 1, "uncorrectable": 0}


def test_the_kernels_section_codes_follow_the_config():
    from megatron_abft.flash import kernels

    codes = [kernels.SCORES, kernels.CONTEXT, kernels.BWD_SCORES, kernels.GRAD_PROBS]
    codes += [kernels.GRAD_V, kernels.GRAD_K, kernels.GRAD_Q]
    assert [c.value for c in codes] == list(range(len(FLASH_SECTIONS)))
    assert kernels.N_SECTIONS.value == len(FLASH_SECTIONS)
