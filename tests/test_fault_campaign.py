"""The fault campaign (campaign.cli) and its modules: the seeded plan (campaign.plan), how a
trial's outcome is judged (campaign.outcomes), the tables and the vulnerability file
(campaign.report), and a tiny campaign end to end (2 workers of 2 gloo ranks each) that
resumes from its results file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from campaign import cli as fc
from campaign.outcomes import OUTCOMES_OFF, classify, magnitude_class
from campaign.plan import (
    KINDS,
    PATTERNS,
    SECTIONS,
    VULNERABILITY_KINDS,
    VULNERABILITY_SECTIONS,
    Settings,
    fault_of,
    plan,
    read_results,
)
from campaign.report import BEGIN, optimizer_check, tables
from megatron_abft.ops import compiled

ROOT = Path(__file__).resolve().parent.parent

TINY_MODEL = ["--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2"]


def settings(**changes) -> Settings:
    args = fc.parse_args(["--trials", "40", "--controls", "4"])
    return Settings(**{**fc.settings_of(args).__dict__, **changes})


def test_the_plan_is_seeded_and_covers_every_combination_before_repeating():
    s = settings(trials=8 * 8 * 4 + 10, controls=10)
    trials = plan(s, num_layers=2, tp_size=2, dtype_bits=32)
    assert trials == plan(s, num_layers=2, tp_size=2, dtype_bits=32)
    assert [t["id"] for t in trials] == list(range(s.trials))
    assert sum(t["control"] for t in trials) == 10
    faulty = [t for t in trials if not t["control"]]
    combos = {(t["section"], t["kind"], t["pattern"]) for t in faulty}
    assert len(combos) == len(SECTIONS) * len(KINDS) * len(PATTERNS)
    for t in faulty:
        assert 1 <= t["step"] <= s.window and 1 <= t["layer"] <= 2 and t["tp_rank"] in (0, 1)
        assert 0 <= t["window"] < s.windows
        if t["kind"] == "bitflip":
            assert 0 <= t["bit"] < 32
        if t["kind"].startswith("value_"):
            assert abs(t["value"]) == float(t["kind"].split("_")[1])
    fault = fault_of(next(t for t in faulty if t["kind"] == "value_1e4"), iteration=25)
    assert fault.kind == "value" and abs(fault.value) == 1e4 and fault.step == 25


def run(non_trainable=False, loss=0.0, params=0.0, detected=None, uncorrectable=0) -> dict:
    out = {"non_trainable": non_trainable, "loss_deviation": loss, "param_deviation": params}
    if detected is not None:
        out.update(detected=detected, uncorrectable=uncorrectable)
    return out


@pytest.mark.parametrize(
    "result, control, outcome",
    [
        (run(non_trainable=True, loss="inf", params="nan"), False, "non_trainable"),
        (run(loss=3e-3), False, "deviated"),
        (run(params=3e-3), False, "deviated"),
        (run(loss=1e-7), False, "masked"),
        (run(detected=1, loss=1e-7, params=1e-8), False, "corrected"),
        (run(detected=1, params=1e-2), False, "miscorrected"),
        (run(detected=3, uncorrectable=2, params=1e-2), False, "reported"),
        (run(detected=0, params=1e-8), False, "masked"),
        (run(detected=0, loss=1e-3), False, "silent"),
        (run(detected=0, non_trainable=True), False, "silent"),
        (run(detected=0), True, "clean"),
        (run(detected=1), True, "false_alarm"),
    ],
)
def test_an_outcome_is_judged_from_detections_and_the_deviation(result, control, outcome):
    assert classify(result, control, tolerance=1e-5) == outcome


def test_the_magnitude_class_of_a_fault():
    assert magnitude_class({"kind": "-inf"}, {}) == "inf"
    assert magnitude_class({"kind": "value_1e8", "value": -1e8}, {}) == "finite"
    flip = {"kind": "bitflip", "section": "q"}
    assert magnitude_class(flip, {"detected_kinds": {"qkv": ["finite", "near_inf"]}}) == (
        "near_inf"
    )
    assert magnitude_class(flip, {"detected_kinds": {}}) == "finite"  # below the limit


def fake_trial(i, section, kind, pattern, off_nt, on_outcome, klass) -> dict:
    """A trial record as the workers write it, with what the report reads."""
    on = {
        "corrected": run(detected=1),
        "reported": run(detected=1, uncorrectable=1, params=1e-2),
        "masked": run(detected=0),
        "silent": run(detected=0, loss=1e-2),
    }[on_outcome]
    on.update(flagged_elsewhere=0)
    off = run(non_trainable=off_nt, loss="inf" if off_nt else 0.0)
    return {"id": i, "control": False, "section": section, "kind": kind, "pattern": pattern,
            "bit": 5, "on": on, "off": off, "class": klass}  # fmt: skip


def test_the_tables_count_the_trials_and_the_vulnerability_file_loads(tmp_path):
    records = [
        fake_trial(0, "q", "inf", "0d", True, "corrected", "inf"),
        fake_trial(1, "scores", "nan", "0d", True, "corrected", "nan"),
        fake_trial(2, "scores", "nan", "row", False, "corrected", "nan"),
        fake_trial(3, "proj", "bitflip", "0d", False, "masked", "finite"),
        fake_trial(4, "context", "inf", "2d", True, "reported", "inf"),
        fake_trial(5, "probs", "value_1e1", "0d", False, "silent", "finite"),
        {"id": 6, "control": True, "on": {**run(detected=0)}},
    ]
    markdown, numbers = tables(records, settings(), [], {"vulnerability": "v.json"})
    headline = numbers["headline"]
    assert headline["corrected_0d_row_col"] == [3, 3]  # the masked flip is not counted as missed
    assert headline["masked_0d_row_col"] == 1
    assert headline["uncorrectable_reported"] == [1, 1]
    assert headline["silent_protected"] == [0, 5]
    assert headline["probs_silent"] == [1, 1]
    assert headline["control_detections"] == 0 and headline["control_trials"] == 1
    off = numbers["non_trainable_off"]
    assert off["all"]["all"] == [3, 6] and off["scores"]["nan"] == [1, 2]
    assert numbers["non_trainable_on"]["all"]["all"] == [0, 6]
    assert numbers["by_section"]["all"]["on_corrected"] == 3
    vulnerability = numbers["vulnerability"]
    assert vulnerability["qkv"]["inf"] == 1.0 and vulnerability["scores"]["nan"] == 1.0
    assert vulnerability["proj"]["finite"] == 0.0
    assert vulnerability["context"]["inf"] == 1.0  # no 0d trial: the defaults fill in
    assert set(vulnerability) == set(VULNERABILITY_SECTIONS)
    assert all(set(v) == set(VULNERABILITY_KINDS) for v in vulnerability.values())
    assert "| **all** | 2/2 | - | 1/2 | - | 0/1 | 0/1 | - | - | 50% (3/6) |" in markdown
    path = tmp_path / "vulnerability.json"
    path.write_text(json.dumps(vulnerability))
    intervals = optimizer_check(path)  # through --abft-vulnerability of the launch script
    assert set(intervals) == {"qkv", "scores", "context", "proj"}


def test_outputs_go_to_out_unless_the_docs_are_asked_for(tmp_path):
    """A campaign writes to out/fault_campaign/; --update-docs to the files docs/ publishes; a
    path given by its own flag wins either way."""
    from campaign.plan import DOCS, OUT, ROOT

    for flags, home in (([], OUT), (["--update-docs"], DOCS)):
        args = fc.parse_args(flags)
        assert {name: Path(getattr(args, name)) for name in home} == home
    assert all(ROOT / "out" in path.parents for path in OUT.values())
    assert all(ROOT / "docs" in path.parents for path in DOCS.values())
    mine = tmp_path / "trials.jsonl"
    assert fc.parse_args(["--update-docs", "--results", str(mine)]).results == mine


def test_bad_flags_name_the_value_and_the_fix(capsys):
    with pytest.raises(SystemExit):
        fc.parse_args(["--kinds", "inf,infinity"])
    assert "unknown infinity; choose from inf,-inf,nan" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        fc.parse_args(["--trials", "4", "--controls", "9"])
    assert "--controls 9: use 0 up to --trials (4)" in capsys.readouterr().err


def test_a_tiny_campaign_runs_in_two_workers_resumes_and_reports(tmp_path):
    """Spawns 2 workers of 2 gloo ranks each (4 processes). Trial 0 is already in the results
    file and trial 3 was cut short by a kill, so trials 1-5 run; a second call finds nothing to
    do; a call with other settings is refused and leaves the file alone."""
    results = tmp_path / "trials.jsonl"
    argv = [
        "--trials", "6", "--controls", "1", "--window", "2", "--windows", "2", "--warmup", "1",
        "--workers", "2", "--results", str(results),
        "--corpus", str(tmp_path / "corpus" / "tiny"), "--doc", str(tmp_path / "doc.md"),
        "--figure", str(tmp_path / "campaign.png"),
        "--vulnerability", str(tmp_path / "vulnerability.json"),
        "--summary", str(tmp_path / "summary.json"), "--", *TINY_MODEL,
    ]  # fmt: skip
    header = fc.settings_of(fc.parse_args(argv)).as_json()
    earlier = {**fake_trial(0, "q", "inf", "0d", True, "corrected", "inf"), "marker": "kept"}
    results.write_text(
        json.dumps({"campaign": header}) + "\n" + json.dumps(earlier) + "\n" + '{"id": 3, "cu'
    )
    assert fc.main(argv) == 0
    _, trials, sessions = read_results(results)
    assert sorted(t["id"] for t in trials) == list(range(6))
    assert next(t for t in trials if t["id"] == 0) == earlier
    assert len(sessions) == 1 and sessions[0]["trials"] == 5
    assert sessions[0]["kernels"] == compiled.backend() and sessions[0]["softmax"] == "fused"
    ran = [t for t in trials if t["id"]]
    assert {t["worker"] for t in ran} == {0, 1}
    for t in ran:
        assert {"on", "reference_losses", "window", "seconds", "class"} <= set(t)
        assert set(t["on"]) >= {"landed", "losses", "non_trainable", "loss_deviation",
                                "param_deviation", "detected", "corrected", "uncorrectable",
                                "outcome"}  # fmt: skip
        assert len(t["on"]["losses"]) == 2 == len(t["reference_losses"])
        if t["control"]:
            assert t["id"] == 3 and "off" not in t and t["on"]["outcome"] == "clean"
        else:
            assert t["on"]["landed"] == t["off"]["landed"] == 1
            assert t["off"]["outcome"] in OUTCOMES_OFF
            assert t["on"]["outcome"] in ("corrected", "reported", "masked")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["trials"] == 6 and summary["non_trainable_off"]["all"]["all"][1] == 5
    doc = (tmp_path / "doc.md").read_text()
    assert doc.count(BEGIN) == 1 and "Protection off" in doc
    assert f"Checks ran with kernels: {compiled.backend()}, softmax: fused." in doc
    vulnerability = json.loads((tmp_path / "vulnerability.json").read_text())
    assert set(vulnerability) == set(VULNERABILITY_SECTIONS)
    assert (tmp_path / "campaign.png").stat().st_size > 0

    before = results.read_text()
    assert fc.main(argv) == 0  # resumed: every trial is there, nothing runs
    assert results.read_text() == before
    assert fc.main(["--seed", "1", *argv]) == 2  # another campaign: refused
    assert results.read_text() == before
