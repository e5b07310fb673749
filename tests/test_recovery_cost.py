"""campaign.recovery (python -m tools.recovery_cost): every recovery method gets a row, with its
cost and its ratio to the in-step correction, from a tiny measurement on 2 gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from campaign import recovery as rc

ROOT = Path(__file__).resolve().parent.parent

METHODS = [
    "(a) in-step correction (ABFT)",
    "(b) Megatron rerun of the step",
    "(c) disk checkpoint, interval 1",
    "(c) disk checkpoint, interval 100",
    "(d) in-memory snapshot, interval 1",
    "(d) in-memory snapshot, interval 100",
]


def result(**medians) -> dict:
    timings = {
        "step_unprotected": 0.030,
        "step_clean_protected": 0.050,
        "step_fault_corrected": 0.053,
        "correction_extra": 0.003,
        "correction_alone": 0.002,
        "forward_backward": 0.025,
        "checkpoint_save": 0.9,
        "checkpoint_load": 0.05,
        "snapshot_take": 0.001,
        "snapshot_restore": 0.001,
        **medians,
    }
    return {"timings": {k: [v] for k, v in timings.items()}}


def test_rows_price_each_method_against_the_correction():
    rows, extra = rc.rows(result(), (1, 100))
    assert [r["method"] for r in rows] == METHODS
    cost = {r["method"]: r["seconds"] for r in rows}
    assert cost[METHODS[0]] == pytest.approx(0.003)
    assert cost[METHODS[2]] == pytest.approx(0.05 + 1 * 0.030)  # load + the faulty step again
    assert cost[METHODS[3]] == pytest.approx(0.05 + 50.5 * 0.030)  # (N + 1) / 2 steps lost
    assert cost[METHODS[4]] == pytest.approx(0.001 + 0.030)
    assert all(r["ratio"] == pytest.approx(r["seconds"] / 0.003) for r in rows)
    assert rows[2]["ready_per_step"] == pytest.approx(0.9)
    assert rows[3]["ready_per_step"] == pytest.approx(0.009)
    assert extra["attnchecker"]["save_plus_load"] == pytest.approx(0.95)


def test_a_step_difference_within_noise_falls_back_to_the_correction_alone():
    rows, extra = rc.rows(result(correction_extra=-0.001), (1,))
    assert extra["basis"] == pytest.approx(0.002)
    assert "within noise" in extra["basis_name"]
    assert rows[0]["seconds"] == pytest.approx(0.002)


def test_a_tiny_measurement_fills_every_row(tmp_path):
    """Spawns 2 gloo ranks (TP=2) for a tiny model and a few repetitions."""
    out = tmp_path / "recovery.json"
    doc = tmp_path / "doc.md"
    doc.write_text("# doc\n\ntext before\n")
    code = rc.main(
        ["--reps", "2", "--ckpt-reps", "1", "--warmup", "1", "--json", str(out),
         "--doc", str(doc), "--figure", str(tmp_path / "r.png"),
         "--corpus", str(tmp_path / "corpus" / "tiny"),
         "--", "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2"]
    )  # fmt: skip
    assert code == 0
    numbers = json.loads(out.read_text())
    assert [r["method"] for r in numbers["rows"]] == METHODS
    assert all(r["seconds"] > 0 and r["ratio"] > 0 for r in numbers["rows"])
    assert numbers["checkpoint_bytes"] > 0 and numbers["parameters_all_ranks"] > 0
    assert len(numbers["timings"]["step_fault_corrected"]) == 2
    text = doc.read_text()
    assert text.startswith("# doc\n\ntext before\n") and text.count(rc.BEGIN) == 1
    assert all(m in text for m in METHODS) and "--reps 2" in text
    assert (tmp_path / "r.png").stat().st_size > 0
    doc.write_text("# doc\n")  # the table is remade from the numbers, with their command
    assert rc.main(["--report-only", "--json", str(out), "--doc", str(doc), "--figure", ""]) == 0
    assert all(m in doc.read_text() for m in METHODS) and "--reps 2" in doc.read_text()


def test_outputs_go_to_out_unless_the_docs_are_asked_for():
    """The study writes to out/recovery_cost/; --update-docs to the files docs/ publishes."""
    for flags, home in (([], rc.OUT), (["--update-docs"], rc.DOCS)):
        args = rc.parse_args(flags)
        assert {name: Path(getattr(args, name)) for name in home} == home
    assert all(rc.SCRATCH in path.parents for path in rc.OUT.values())
    assert all(rc.ROOT / "docs" in path.parents for path in rc.DOCS.values())


def test_bad_intervals_name_the_fix(capsys):
    with pytest.raises(SystemExit):
        rc.parse_args(["--intervals", "1,x"])
    assert "use comma-separated ints such as 1,100" in capsys.readouterr().err
