"""megatron_abft.runtime.telemetry: counters and events gathered once per log interval from every
rank to the logging rank, and written to the console, a JSONL file and a W&B run from that rank
only."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
from mcore import Shape, build_gpt, loss_and_grads, spawn

from megatron_abft import Fault
from megatron_abft.config import ABFTConfig
from megatron_abft.runtime.telemetry import EVENT_COLUMNS, TelemetryConfig

SHAPE = Shape(heads=4, groups=2)


class FakeRun:
    """Stands in for a wandb run: records what is logged."""

    def __init__(self):
        self.logged: list[tuple[dict, int | None]] = []
        self.summary: dict = {}
        self.dir = None

    def log(self, data: dict, step: int | None = None) -> None:
        self.logged.append((data, step))


def _telemetry_worker(events_file: str):
    import torch

    from megatron_abft import finish_step, inject, set_step
    from megatron_abft.runtime.telemetry import Telemetry
    from megatron_abft.spec import get_gpt_layer_abft_spec

    model = build_gpt(SHAPE, get_gpt_layer_abft_spec(ABFTConfig(on_uncorrectable="log")))
    stream, printed, run = io.StringIO(), io.StringIO(), FakeRun()
    config = TelemetryConfig(log_interval=2, train_iters=3, events_file=events_file, policy="log")
    telemetry = Telemetry(model, config, num_layers=SHAPE.layers, wandb_run=run, stream=stream)
    seq = SHAPE.seq
    faults = {
        1: [Fault("scores", "inf", "0d", layer=1, tp_rank=0, step=1, seed=1)],  # corrected
        2: [  # every element of one matrix: uncorrectable in place
            Fault("scores", "inf", "2d", layer=2, tp_rank=0, step=2, block=(seq, seq), seed=4)
        ],
        3: [],
    }
    intervals = []
    for step in (1, 2, 3):
        set_step(model, step)
        with inject(model, faults[step]) as landed:
            loss_and_grads(model, SHAPE, step)
        telemetry.count_injected(len(landed))
        with contextlib.redirect_stderr(printed):
            finish_step(model)
        if step % 2 == 0 or step == 3:
            intervals.append(telemetry.log(step, {"lm loss": 2.5, "learning-rate": 1e-3}))
    telemetry.close({"final lm loss": 2.5})
    table = next((data["abft/events"] for data, _ in run.logged if "abft/events" in data), None)
    return {
        "rank": torch.distributed.get_rank(),
        "console": stream.getvalue(),
        "stderr": printed.getvalue(),
        "intervals": intervals,
        "logged": [
            (sorted(k for k in data if k != "abft/events"), step) for data, step in run.logged
        ],
        "table": None if table is None else (table.columns, len(table.data)),
        "summary": run.summary,
    }


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Spawns 2 gloo ranks (TP=2): faults land on TP rank 0, the logging rank is rank 1."""
    events = tmp_path_factory.mktemp("telemetry") / "events.jsonl"
    results = spawn(2, 2, _telemetry_worker, str(events))
    for rank, result in enumerate(results):
        if isinstance(result, Exception):
            raise AssertionError(f"rank {rank} failed") from result
    return results, events


def test_counters_are_summed_over_ranks_on_every_rank(ranks):
    results, _ = ranks
    for result in results:
        first, second = result["intervals"]
        assert first.totals["injected"] == 2
        assert first.totals["corrected"] == 1
        assert first.totals["uncorrectable"] >= 1  # the INF matrix, and where its NaNs spread
        assert first.totals["detected"] == first.totals["corrected"] + first.totals["uncorrectable"]
        assert second.delta == {k: 0 for k in second.delta}  # nothing new in step 3
        assert first.scalars["abft/rank0/detected"] >= 2
        assert first.scalars["abft/layer1/corrected"] == 1
        assert first.scalars["abft/scores/corrected"] == 1
        assert first.scalars["abft/kind/inf/corrected"] == 1


def test_events_reach_the_logging_rank_only(ranks):
    results, _ = ranks
    assert results[0]["intervals"][0].events == []  # rank 0 saw them but handed them over
    events = results[1]["intervals"][0].events
    corrected = [e for e in events if e["action"] == "corrected"]
    assert [(e["rank"], e["layer"], e["section"], e["step"]) for e in corrected] == [
        (0, 1, "scores", 1)
    ]
    assert corrected[0]["head"] >= 0 and corrected[0]["kind"] == "inf"
    origin = [e for e in events if e["action"] == "uncorrectable" and e["layer"] == 2]
    assert (0, "scores", 2) in {(e["rank"], e["section"], e["step"]) for e in origin}
    assert all(e["policy"] == "log" for e in events)


def test_console_lines_in_megatron_style_and_each_uncorrectable_fault_printed_once(ranks):
    """The logging rank prints the counters; the rank that finds an uncorrectable fault prints
    it, once, when the policy decides (finish_step), and the log does not repeat it."""
    results, _ = ranks
    assert results[0]["console"] == ""
    lines = results[1]["console"].splitlines()
    steps = [line for line in lines if line.startswith(" iteration")]
    assert steps[0].startswith(
        " iteration        2/       3 | lm loss: 2.500000E+00 | learning rate: 1.000000E-03 |"
    )
    assert "abft injected/detected/corrected/uncorrectable: 2/" in steps[0]
    assert steps[1].endswith("abft injected/detected/corrected/uncorrectable: 0/0/0/0 |")
    assert not any("UNCORRECTABLE" in line for line in lines)
    assert results[1]["stderr"] == ""
    loud = results[0]["stderr"].splitlines()
    uncorrectable = [e for e in results[1]["intervals"][0].events if e["action"] != "corrected"]
    where = {(e["layer"], e["section"]) for e in uncorrectable}
    assert len(loud) == len(where) >= 1  # a line for each (layer, section) that holds faults
    assert any("Rank 0" in line and "iteration 2: layer 2 section scores" in line for line in loud)
    assert all("UNCORRECTABLE" in line and "policy log: logged only" in line for line in loud)


def test_the_jsonl_file_holds_every_event(ranks):
    results, path = ranks
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == len(results[1]["intervals"][0].events)
    assert all(list(r) == list(EVENT_COLUMNS) for r in records)
    assert any(r["magnitude"] in ("inf", "nan") or r["magnitude"] > 0 for r in records)


def test_wandb_gets_metrics_abft_scalars_and_the_events_table_from_one_rank(ranks):
    results, _ = ranks
    assert results[0]["logged"] == [] and results[0]["table"] is None
    logged = results[1]["logged"]
    assert [step for _, step in logged] == [2, 3, 3]  # two intervals, then the table
    keys = logged[0][0]
    assert {"lm loss", "learning-rate", "abft/injected", "abft/detected", "abft/corrected",
            "abft/uncorrectable", "abft/recomputed", "abft/qkv/detected"} <= set(keys)  # fmt: skip
    columns, rows = results[1]["table"]
    assert columns == list(EVENT_COLUMNS) and rows == len(results[1]["intervals"][0].events)
    assert results[1]["summary"]["abft/corrected"] == 1
    assert results[1]["summary"]["final lm loss"] == 2.5


def test_telemetry_config_checks_its_values(monkeypatch):
    with pytest.raises(ValueError, match="log_interval: 0; use an int >= 1"):
        TelemetryConfig(log_interval=0)
    with pytest.raises(ValueError, match="wandb_mode: 'cloud'; choose from online, offline"):
        TelemetryConfig(wandb_mode="cloud")
    with pytest.raises(ValueError, match="needs a run name: set --wandb-exp-name"):
        TelemetryConfig(wandb_project="p")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert TelemetryConfig().resolved_wandb_mode == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert TelemetryConfig().resolved_wandb_mode == "online"
    assert TelemetryConfig(wandb_mode="offline").resolved_wandb_mode == "offline"


def test_importing_telemetry_does_not_import_wandb():
    import subprocess
    import sys

    code = "import megatron_abft.runtime.telemetry, sys; print('wandb' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr
