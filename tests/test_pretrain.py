"""pretrain/pretrain_gpt.py, launched with torchrun as a user would: clean and faulty runs train
alike, checkpoints resume exactly, the plain Megatron loop (--no-abft) matches the protected one,
pipeline parallelism works, the W&B offline run holds the fault telemetry, and bad flags or config
values stop the script at start with a message that names them.

Every launch spawns 2 gloo ranks on CPU (TP=2, or PP=2 where said) and runs a few steps of the
tiny config; the launches are shared between tests through module-scoped fixtures."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_abft.config import BACKWARD_SECTIONS, FORWARD_SECTIONS, SECTIONS

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ["-m", "pretrain.pretrain_gpt"]  # run from the repository root, as the docs do
TINY = ROOT / "configs" / "tiny_cpu.yaml"
STEPS = 6
EVENT_FIELDS = ("step", "rank", "tp_rank", "layer", "section", "sample", "head", "row", "col",
                "kind", "magnitude", "action", "policy")  # fmt: skip


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    return env


def launch(*flags: str, save: Path, nproc: int = 2) -> dict:
    """Run the script under torchrun on ``nproc`` gloo ranks; return its summary.json."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", *SCRIPT, "--config", str(TINY),
        "--train-iters", str(STEPS), "--lr-warmup-iters", "1", "--log-interval", "1",
        "--save", str(save), "--wandb-project", "", *flags,
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    summary = json.loads((save / "summary.json").read_text())
    summary["stdout"], summary["stderr"] = done.stdout, done.stderr
    return summary


def losses(summary: dict) -> list[float]:
    return [summary["losses"][str(i)] for i in range(1, summary["iterations"] + 1)]


def assert_same_curve(a: list[float], b: list[float], rel: float = 1e-5) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True), start=1):
        assert abs(x - y) <= rel * abs(y), f"iteration {i}: {x} vs {y}"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """The shipped text corpus as a Megatron indexed dataset, by the script
    (tools/prepare_data.py)."""
    prefix = tmp_path_factory.mktemp("corpus") / "tiny_corpus"
    texts = [str(p) for p in sorted((ROOT / "data" / "tiny_corpus").glob("*.txt"))]
    command = [sys.executable, "-m", "tools.prepare_data", "--input", *texts]
    done = subprocess.run(
        [*command, "--output-prefix", str(prefix)], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    counted = re.search(r"(\d+) documents, (\d+) tokens", done.stdout)
    assert counted and int(counted[1]) > 10 and int(counted[2]) > 10_000, done.stdout
    assert prefix.with_suffix(".bin").stat().st_size == 2 * int(counted[2])  # uint16 tokens
    return prefix


WHOLE_MATRIX = "section=scores,layer=2,kind=inf,pattern=2d,block=64x64,step=4,tp-rank=1,seed=3"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus) -> dict[str, dict]:
    """Clean and faulty protected runs on the real corpus, saving at step 3 and at the end. The
    faulty run gets a random fault every step, and at step 4 also INF in every element of one
    scores matrix (beyond in-place correction: the default policy recomputes the GEMM)."""
    tmp = tmp_path_factory.mktemp("runs")
    data = ["--data-path", str(corpus), "--save-interval", "3"]
    clean = launch(*data, "--abft-inject-every", "0", save=tmp / "clean")
    faulty = launch(
        *data,
        "--abft-inject-every", "1", "--abft-inject", WHOLE_MATRIX,
        "--wandb-project", "abft-test", "--wandb-exp-name", "faulty", "--wandb-mode", "offline",
        save=tmp / "faulty",
    )  # fmt: skip
    return {"clean": clean, "faulty": faulty, "dir": tmp}


def test_clean_and_faulty_runs_give_the_same_loss_curve(runs):
    """A fault in every step, in a random section, layer and TP rank, is corrected in place; the
    whole-matrix fault is recomputed; the loss curve is the clean one up to fp32 rounding."""
    clean, faulty = runs["clean"], runs["faulty"]
    assert clean["faults_injected"] == clean["faults_detected"] == 0
    assert faulty["faults_injected"] == STEPS + 1
    assert faulty["faults_detected"] == STEPS + 1 and faulty["faults_corrected"] == STEPS
    assert faulty["faults_uncorrectable"] == faulty["faults_recomputed"] == 1
    assert faulty["skipped_iterations"] == 0
    assert_same_curve(losses(faulty), losses(clean))
    assert losses(clean)[-1] < losses(clean)[0]  # it learns
    events = [json.loads(line) for line in Path(faulty["events_file"]).read_text().splitlines()]
    assert sorted(e["step"] for e in events) == [1, 2, 3, 4, 4, 5, 6]
    [whole] = [e for e in events if e["action"] != "corrected"]
    assert (whole["action"], whole["layer"], whole["section"], whole["tp_rank"]) == (
        "recomputed", 2, "scores", 1,
    )  # fmt: skip
    assert all(e["policy"] == "recompute" for e in events)
    assert set(EVENT_FIELDS) <= set(events[0])
    console = [line for line in faulty["stdout"].splitlines() if line.startswith(" iteration")]
    assert len(console) == STEPS
    assert "lm loss:" in console[0]
    assert "abft injected/detected/corrected/uncorrectable: 1/1/1/0" in console[0]
    assert "abft injected/detected/corrected/uncorrectable: 2/2/1/1" in console[3]
    [loud] = [line for line in faulty["stdout"].splitlines() if "UNCORRECTABLE" in line]
    assert "Rank 1" in loud and "iteration 4: layer 2 section scores" in loud
    assert "recomputed the GEMM" in loud
    assert "UNCORRECTABLE" not in faulty["stderr"]  # printed once


def test_a_checkpoint_resumes_to_the_same_losses(runs, corpus):
    """Resuming the clean run from its step-3 checkpoint (model, optimizer, LR schedule, RNG,
    data position) reproduces its steps 4 to 6."""
    resumed = launch(
        "--data-path", str(corpus), "--abft-inject-every", "0",
        "--load", str(runs["dir"] / "clean"), "--ckpt-step", "3",
        save=runs["dir"] / "resumed",
    )  # fmt: skip
    assert sorted(map(int, resumed["losses"])) == [4, 5, 6]
    for step in ("4", "5", "6"):
        assert resumed["losses"][step] == pytest.approx(runs["clean"]["losses"][step], rel=1e-6)


def test_without_abft_the_plain_megatron_loop_gives_the_protected_loss(runs, corpus):
    """--no-abft builds GPTModel on Megatron's local spec: on clean data its losses equal the
    protected run's."""
    plain = launch(
        "--data-path", str(corpus), "--no-abft", "--abft-inject-every", "0",
        save=runs["dir"] / "plain",
    )  # fmt: skip
    assert not plain["abft"] and "ABFT: off" in plain["stdout"]
    assert_same_curve(losses(plain), losses(runs["clean"]), rel=1e-6)


def test_pipeline_parallel_with_skip_step_on_mock_data(tmp_path):
    """TP=1, PP=2 (2 ranks) on MockGPTDataset, policy skip_step: a fault in each stage is
    corrected, and a NaN in the softmax output on the first stage makes step 4 uncorrectable on
    both stages (its context checksums are NaN, and the NaNs reach the second stage), so every
    rank skips that step; the last rank reports it all.
    Untied embeddings: with tied ones Megatron syncs the two copies through ``Tensor.cuda()``
    (language_module.py:307), which CPU mode does not cover."""
    run = launch(
        "--mock-data", "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
        "--untie-embeddings-and-output-weights", "--abft-on-uncorrectable", "skip_step",
        "--abft-inject-every", "0",
        "--abft-inject", "section=scores,layer=1,kind=nan,pattern=row,step=2",
        "--abft-inject", "section=proj,layer=2,kind=inf,step=3",
        "--abft-inject", "section=probs,layer=1,kind=nan,step=4",
        save=tmp_path / "pp",
    )  # fmt: skip
    assert "PP=2" in run["stdout"] and "MockGPTDataset" in run["stdout"]
    assert run["faults_injected"] == 3 and run["faults_corrected"] == 2
    assert run["faults_uncorrectable"] >= 1 and run["skipped_iterations"] == 1
    assert sorted(map(int, run["losses"])) == [1, 2, 3, 5, 6]  # skipped steps are not averaged
    assert all(map(math.isfinite, run["losses"].values()))
    assert run["losses"]["6"] < run["losses"]["1"]
    assert "UNCORRECTABLE" not in run["stdout"]  # printed once: by the rank that found it
    loud = [line for line in run["stderr"].splitlines() if "UNCORRECTABLE" in line]
    assert any("iteration 4: layer 1 section context" in line for line in loud)
    assert all("policy skip_step: the step is skipped" in line for line in loud)
    assert len(loud) == len(set(loud))


def test_log_with_a_nan_loss_still_prints_and_records_the_fault(tmp_path):
    """TP=2, policy log: a NaN in the softmax output at step 2 cannot be corrected and makes the
    loss NaN, which stops the run; the fault is printed at once and reaches the events file."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        *SCRIPT, "--config", str(TINY), "--mock-data", "--train-iters", "3",
        "--lr-warmup-iters", "1", "--log-interval", "10", "--save", str(tmp_path),
        "--wandb-project", "", "--abft-inject-every", "0", "--abft-on-uncorrectable", "log",
        "--abft-inject", "section=probs,layer=1,kind=nan,step=2,tp-rank=1",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True)
    assert done.returncode != 0 and "the loss is nan" in done.stderr
    assert "Rank 1, node" in done.stderr and "iteration 2: layer 1 section context" in (done.stderr)
    events = [json.loads(line) for line in (tmp_path / "abft_events.jsonl").open()]
    assert any(
        (e["step"], e["tp_rank"], e["layer"], e["section"], e["action"], e["policy"])
        == (2, 1, 1, "context", "uncorrectable", "log")
        for e in events
    )


# --- W&B ---------------------------------------------------------------------------------------


def wandb_records(run_dir: Path):
    """The records of a W&B offline run file (run-*.wandb: LevelDB-style log of protobufs)."""
    from wandb.proto import wandb_internal_pb2

    raw = next(run_dir.glob("run-*.wandb")).read_bytes()
    assert raw[:4] == b":W&B"
    block, pos, chunk = 32768, 7, b""
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        chunk, pos = chunk + raw[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            yield record
            chunk = b""


def _key(item) -> str:
    """A history item's key: W&B stores keys with a slash as a one-element nested key."""
    return item.key or "/".join(item.nested_key)


def test_the_wandb_offline_run_holds_abft_scalars_and_the_events_table(runs):
    faulty = runs["faulty"]
    run_dir = Path(faulty["wandb_dir"])
    assert run_dir.name.startswith("offline-run-")
    assert run_dir.is_relative_to(runs["dir"] / "faulty" / "wandb")  # <save>/wandb by default
    history = [
        r.history for r in wandb_records(run_dir) if r.WhichOneof("record_type") == "history"
    ]
    rows = [{_key(i): json.loads(i.value_json) for i in h.item} for h in history]
    keys = {key for row in rows for key in row}
    for key in ("lm loss", "learning-rate", "tokens-per-sec", "grad-norm", "abft/injected",
                "abft/detected", "abft/corrected", "abft/uncorrectable", "abft/scores/detected",
                "abft/kind/inf/detected"):  # fmt: skip
        assert key in keys, key
    assert not any(key.startswith("abft/grad_") for key in keys)  # the unfused path's sections
    counted = [row for row in rows if "abft/corrected" in row]
    assert [row["_step"] for row in counted] == list(range(1, STEPS + 1))
    assert [row["abft/corrected"] for row in counted] == list(range(1, STEPS + 1))
    [table_path] = [row["abft/events/path"] for row in rows if "abft/events/path" in row]
    table = json.loads((run_dir / "files" / table_path).read_text())
    assert table["columns"][:5] == ["step", "rank", "tp_rank", "layer", "section"]
    assert len(table["data"]) == STEPS + 1  # the random faults and the whole-matrix one
    config = {  # the run's config: in its run record, and in config records if it changes
        item.key: json.loads(item.value_json)
        for record in wandb_records(run_dir)
        if record.WhichOneof("record_type") in ("run", "config")
        for item in (record.run if record.HasField("run") else record).config.update
    }
    typed = {key: config[key] for key in ("num_layers", "lr", "abft", "abft_sections", "save")}
    assert typed == {
        "num_layers": 2, "lr": 3e-3, "abft": True, "abft_sections": list(SECTIONS),
        "save": str(runs["dir"] / "faulty"),
    }, typed  # fmt: skip
    # a fault is its spec, keys in parse_fault's order: it reads back as the same fault
    assert config["abft_inject"] == [
        "section=scores,kind=inf,pattern=2d,layer=2,step=4,tp-rank=1,seed=3,block=64x64"
    ]


# --- flags and config files, checked at start --------------------------------------------------


def test_yaml_sets_flags_and_the_command_line_wins(tmp_path):
    from pretrain.arguments import parse_args

    args = parse_args(["--config", str(TINY), "--mock-data"], world_size=2)
    assert (args.num_layers, args.hidden_size, args.tensor_model_parallel_size) == (2, 64, 2)
    assert args.abft and args.abft_inject_every == 3 and args.abft_on_uncorrectable == "recompute"
    assert args.wandb_project == "megatron-abft-demo" and args.wandb_mode == "offline"
    assert args.abft_sections == SECTIONS  # the config lists none: every section

    args = parse_args(
        [
            "--config",
            str(TINY),
            "--mock-data",
            "--lr",
            "0.5",
            "--no-abft",
            "--abft-sections",
            "scores",
        ],
        world_size=2,
    )
    assert args.lr == 0.5 and not args.abft and args.abft_sections == ("scores",)

    config = tmp_path / "faults.yaml"
    config.write_text(
        "abft:\n  enabled: true\n  check-interval: {scores: 1, qkv: 4}\n"
        "  inject:\n    - {section: scores, layer: 1, kind: inf, step: 5}\n"
        "    - section=proj,layer=2,kind=nan,step=7\n"
        "training:\n  train-iters: 20\n"
    )
    args = parse_args(["--config", str(config)], world_size=1)
    assert args.abft_check_interval == {"scores": 1, "qkv": 4}
    assert [(f.section, f.step) for f in args.abft_inject] == [("scores", 5), ("proj", 7)]
    args = parse_args(
        ["--config", str(config), "--abft-inject", "section=qkv,layer=1,kind=nan,step=3"],
        world_size=1,
    )
    assert [(f.section, f.step) for f in args.abft_inject] == [("qkv", 3)]  # replaced, not merged


def test_a_coverage_target_sets_the_check_intervals():
    """The check-frequency optimizer picks the sections and intervals
    (megatron_abft.tuning.frequency): nothing for a zero target, every section every step for full
    coverage, and in between the cheapest sections first, whose choice the launch banner logs."""
    from megatron_abft.flags import abft_config_from_args
    from pretrain.arguments import parse_args

    def config(*flags):
        args = parse_args(["--config", str(TINY), "--mock-data", "--abft", *flags], world_size=2)
        return abft_config_from_args(args)

    full = config("--abft-coverage-target", "1")
    assert full.sections == SECTIONS
    assert {full.interval(s) for s in full.sections} == {1}
    assert config("--abft-coverage-target", "0").sections == ()
    half = config("--abft-coverage-target", "0.5", "--abft-fault-rates", "nan=1")
    forward = [s for s in half.sections if s in FORWARD_SECTIONS]
    assert 0 < len(forward) < 4 and half.sections == (*forward, *BACKWARD_SECTIONS)
    assert config("--abft-coverage-target", "0.5", "--abft-sections", "qkv").sections == (
        half.sections
    )  # the target overrides --abft-sections


def test_every_config_field_is_one_flag_with_its_docstring_as_help(tmp_path):
    """add_abft_args makes the flags of ABFTConfig's fields from the fields: one flag each, its
    help the field's docstring, its default the config's (--abft's and the events file's are
    the command line's own), and a value given on the command line or in a YAML file reaches
    the config. docs/pretraining.md names every ABFT flag."""
    import dataclasses

    from megatron_abft.config import ABFTConfig
    from megatron_abft.flags import (
        CONFIG_FLAGS,
        abft_config_from_args,
        config_flag,
        field_docstrings,
        flag_names,
    )
    from pretrain.arguments import build_parser, parse_args

    names = [f.name for f in dataclasses.fields(ABFTConfig) if f.init]
    assert list(CONFIG_FLAGS) == names
    parser = build_parser()
    actions = {o: a for a in parser._actions for o in a.option_strings}
    for name in names:
        help_text = " ".join(actions[config_flag(name)].help.split())
        assert len(field_docstrings()[name]) > 40 and field_docstrings()[name] in help_text, name

    def config(*flags):
        return abft_config_from_args(parse_args(["--mock-data", *flags], world_size=1))

    by_default = config("--abft")
    assert os.path.normpath(by_default.events_file) == ABFTConfig().events_file
    assert dataclasses.replace(by_default, events_file=ABFTConfig().events_file) == ABFTConfig()
    assert not config().enabled  # --abft is off by default on the command line
    events = str(tmp_path / "events.jsonl")
    given = {
        "enabled": (["--no-abft"], False),
        "sections": (["--abft-sections", "scores,qkv"], ("qkv", "scores")),
        "check_interval": (["--abft-check-interval", "scores=2"], {"scores": 2}),
        "block_size": (["--abft-block-size", "64"], 64),
        "threshold_scale": (["--abft-threshold-scale", "2.5"], 2.5),
        "near_inf": (["--abft-near-inf", "1e6"], 1e6),
        "sync_free": (["--no-abft-sync-free"], False),
        "fused_softmax": (["--no-abft-fused-softmax"], False),
        "checked_gemm": (["--abft-checked-gemm"], True),
        "on_uncorrectable": (["--abft-on-uncorrectable", "raise"], "raise"),
        "events_file": (["--abft-events-file", events], events),
    }
    assert list(given) == names
    for name, (flags, value) in given.items():
        assert getattr(config("--abft", *flags), name) == value, name
        assert value != getattr(ABFTConfig(), name), name
    assert config("--abft", "--abft-sync-free").sync_free is True

    yaml_file = tmp_path / "abft.yaml"
    yaml_file.write_text(
        "abft:\n  enabled: true\n  sync_free: false\n  fused_softmax: false\n"
        "  near_inf: 1.0e+6\n  block_size: 64\n"
    )
    made = abft_config_from_args(parse_args(["--mock-data", "--config", str(yaml_file)], 1))
    assert (made.sync_free, made.fused_softmax, made.near_inf, made.block_size) == (
        False,
        False,
        1e6,
        64,
    )

    docs = (ROOT / "docs" / "pretraining.md").read_text()
    flags = [f for f in flag_names(parser) if f.startswith(("--abft", "--no-abft"))]
    assert len(flags) > len(names)
    for flag in flags:
        assert f"`{flag}" in docs, flag


BAD = [
    (["--abft-on-uncorrectable", "explode"], "invalid choice: 'explode'"),
    (["--abft-sections", "qkv,qk"], "unknown section 'qk'; choose from qkv, scores"),
    (["--abft-inject", "section=scores,layer=1,kind=inf"], "step= is missing"),
    (["--abft-inject", "section=scores,lyer=1,step=2"], "'lyer=1' is not a key=value pair"),
    (["--abft-inject", "section=scores,layer=9,step=2"], "layer=9 is not a layer of this model"),
    (["--abft-inject", "section=scores,pattern=2d,block=4by4,step=2"], "block='4by4' is not rows "
     "x columns such as 4x4"),
    (["--abft-check-interval", "scores=0"], "use an int >= 1"),
    (["--abft-attention", "flashy"], "invalid choice: 'flashy'"),
    (["--abft-inject", "section=scores,step=2,persistent=maybe"], "persistent='maybe' is not "
     "yes or no"),
    (["--abft-inject", "section=grad_q,step=2"], "section=grad_q is not in the unfused "
     "attention this run builds"),  # auto, without a GPU
    (["--abft-attention", "flash", "--abft-inject", "section=probs,step=2"], "section=probs is "
     "not in the flash attention this run builds"),
    (["--abft-attention", "flash", "--attention-dropout", "0.1"], "--abft-attention flash needs "
     "--attention-dropout 0"),
    (["--abft-coverage-target", "abc"], "'abc' is not between 0 and 1"),
    (["--abft-vulnerability", "nowhere.json"], "--abft-vulnerability nowhere.json: "
     "FileNotFoundError"),
    (["--abft-events-file", "/"], "--abft-events-file /: cannot be written"),
    (["--abft-coverage-target", "1.5"], "'1.5' is not between 0 and 1"),
    (["--abft-fault-rates", "inf=1,bitrot=2"], "unknown fault kind 'bitrot'"),
    (["--abft-fault-rates", "nan=-1"], "rate of 'nan' must be >= 0"),
    (["--num-attention-heads", "3", "--hidden-size", "66"], "--num-attention-heads 3 is not "
     "divisible by --tensor-model-parallel-size 2"),
    (["--lr-warmup-iters", "500"], "--lr-warmup-iters 500"),
    (["--data-path", "nowhere/corpus"], "nowhere/corpus.bin, nowhere/corpus.idx not found"),
    (["--wandb-exp-name", ""], "--wandb-project megatron-abft-demo needs --wandb-exp-name"),
    (["--abft-inject", "section=context,pattern=2d,block=32x32,step=2"], "block=32x32 does not "
     "fit section context's 64x16 matrix"),
    (["--abft-inject", "section=scores,kind=bitflip,bit=40,step=2"], "40 is not a bit of a "
     "checked value; use 0..31"),
    (["--abft-block-size", "1"], "'1' is not an int between 2 and 65536"),
    (["--abft-inject", "section=scores,step=301"], "step=301 is outside the run; use 1..300"),
    (["--abft-sections", ""], "'' names no section"),
]  # fmt: skip


@pytest.mark.parametrize("flags, message", BAD, ids=[" ".join(f) for f, _ in BAD])
def test_a_bad_flag_fails_at_start_with_a_clear_message(flags, message, capsys):
    from pretrain.arguments import parse_args

    with pytest.raises(SystemExit) as exit_:
        parse_args(["--config", str(TINY), *flags], world_size=2)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert "usage:" not in err and len(err.splitlines()) <= 6  # the message, not the usage


def test_a_bad_flag_is_printed_by_rank_0_only(monkeypatch, capsys):
    """Under torchrun every rank parses the flags; one message, not one per rank."""
    from pretrain.arguments import parse_args

    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--config", str(TINY), "--abft-block-size", "1"], world_size=2)
    assert exit_.value.code == 2 and capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "content, message",
    [
        ("abft:\n  on-uncorrectable: explode\n", "{path}: argument --abft-on-uncorrectable: "
         "invalid choice: 'explode'"),
        ("model:\n  hiden-size: 64\n", "{path}: unknown key 'hiden-size'; did you mean "
         "hidden-size?"),
        ("abft:\n  enabled: maybe\n", "{path}: abft: 'maybe' is not true or false"),
        ("- just\n- a list\n", "expected a mapping of flag: value"),
    ],
)  # fmt: skip
def test_a_bad_config_value_names_the_file(content, message, tmp_path, capsys):
    from pretrain.arguments import parse_args

    config = tmp_path / "bad.yaml"
    config.write_text(content)
    with pytest.raises(SystemExit):
        parse_args(["--config", str(config)], world_size=1)
    assert message.format(path=config) in capsys.readouterr().err


def test_the_launched_script_stops_before_starting_ranks_on_a_bad_value(tmp_path):
    """Plain python, 1 process: the error comes from the flags, before torch.distributed."""
    done = subprocess.run(
        [sys.executable, *SCRIPT, "--config", str(TINY), "--abft-inject-every", "-2"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert "argument --abft-inject-every: '-2' is not an int >= 0 (0 = off)" in done.stderr


def test_plain_python_runs_as_one_rank(tmp_path):
    """Without torchrun the script is one rank; its banner names the attention built, only that
    attention's sections, and what a check interval above 1 leaves unchecked. No fault: no
    events file."""
    done = subprocess.run(
        [sys.executable, *SCRIPT, "--config", str(TINY), "--mock-data", "--train-iters", "1",
         "--lr-warmup-iters", "0", "--tensor-model-parallel-size", "1", "--abft-inject-every",
         "0", "--abft-check-interval", "scores=4", "--wandb-project", "", "--save",
         str(tmp_path)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert "1 ranks: TP=1 PP=1 DP=1 (gloo)" in done.stdout
    assert not (tmp_path / "abft_events.jsonl").exists()  # created with the first event only
    assert (
        "> ABFT: on, unfused attention: check every N steps qkv=1,scores=4,context=1,proj=1,"
        in done.stdout
    )
    assert (
        "[abft] check intervals above 1 (scores every 4 steps): a fault in a step between two "
        "checks of its section is not detected" in done.stdout
    )


def test_every_shipped_config_parses_for_its_world_size():
    from megatron_abft.flags import abft_config_from_args
    from pretrain.arguments import parse_args

    worlds = {"tiny_cpu": 2, "gpt3_125m": 8, "gpt3_350m": 8, "gpt3_1.3b": 8, "llama2_7b": 8}
    configs = sorted((ROOT / "configs").glob("*.yaml"))
    assert {c.stem for c in configs} == set(worlds)
    for config in configs:
        args = parse_args(["--config", str(config), "--mock-data"], world_size=worlds[config.stem])
        assert args.abft, config.name
        # every section of either path: on a GPU (flash) the backward is checked too
        assert abft_config_from_args(args).sections == SECTIONS, config.name


# --- the fault plan ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [
        "section=scores,kind=inf,step=2",
        "section=grad_k,kind=bitflip,layer=1,step=7,tp-rank=1,bit=12,persistent=yes",
        "section=context,kind=value,pattern=row,step=3,value=-250.5,seed=4",
        WHOLE_MATRIX,
    ],
)
def test_a_fault_spec_reads_back_as_the_same_fault(spec):
    """fault_spec writes what the W&B config shows of --abft-inject; parse_fault reads it."""
    from megatron_abft.fault_plan import fault_spec, parse_fault

    fault = parse_fault(spec)
    assert parse_fault(fault_spec(fault)) == fault


def test_the_random_fault_stream_is_seeded_correctable_and_spans_the_sections():
    from megatron_abft.fault_plan import MATRIX_SECTIONS, FaultPlan

    plan = FaultPlan(every=3, num_layers=4, tp_size=2, seed=7)
    faults = [f for step in range(1, 601) for f in plan.at(step)]
    assert [f.step for f in faults] == list(range(3, 601, 3))
    assert faults == [f for step in range(1, 601) for f in FaultPlan(**vars(plan)).at(step)]
    assert {f.section for f in faults} == {"qkv", "q", "k", "v", "scores", "context", "proj"}
    assert {f.layer for f in faults} == {1, 2, 3, 4} and {f.tp_rank for f in faults} == {0, 1}
    assert {f.kind for f in faults} == {"inf", "-inf", "nan", "near_inf", "bitflip", "value"}
    assert all(f.pattern == "0d" or f.section in MATRIX_SECTIONS for f in faults)
    assert all(f.bit == 30 for f in faults if f.kind == "bitflip")  # fp32's top exponent bit
    other_seed = [f for step in range(1, 601) for f in FaultPlan(every=3, seed=8).at(step)]
    assert other_seed != faults
    mqa = FaultPlan(every=1, num_layers=2, tp_size=2, num_query_groups=1)
    assert not {f.section for s in range(1, 300) for f in mqa.at(s)} & {"k", "v"}


# --- Megatron-LM's own training script -----------------------------------------------------------

MEGATRON_LM = """
import logging, os, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
from megatron.training.log_handler import CustomHandler
logging.basicConfig(handlers=[CustomHandler()], level=logging.INFO)  # as megatron.training does
from megatron_abft.cpu import enable_cpu_mode
enable_cpu_mode()
import torch
torch.distributed.init_process_group("gloo", rank=0, world_size=1)
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.training.argument_utils import gpt_config_from_args
from megatron.training.arguments import parse_args, validate_args
from megatron.training.global_vars import set_args
from megatron.training.models.gpt import GPTModelBuilder
from megatron_abft.megatron_lm import add_abft_args

parallel_state.initialize_model_parallel()
sys.argv = ["pretrain_gpt.py", *sys.argv[2:]]
args = parse_args(extra_args_provider=add_abft_args)
validate_args(args)
set_args(args)
print("POLICY", args.abft_on_uncorrectable, args.abft_inject[0].section)
for abft in (True, False):  # --no-abft and no faults: Megatron's own local spec
    args.abft, args.abft_inject = abft, args.abft_inject if abft else None
    model = GPTModelBuilder(gpt_config_from_args(args)).build_model(
        ProcessGroupCollection.use_mpu_process_groups()
    )
    attention = model.decoder.layers[0].self_attention
    names = [type(m).__name__ for m in (attention.core_attention, attention.linear_qkv)]
    print("BUILT", abft, *names)
import megatron_abft.spec
megatron_abft.spec.kernels_compile_here = lambda: True  # as on a GPU
args.abft = True  # attention auto, with Megatron-LM's default attention dropout (0.1)
model = GPTModelBuilder(gpt_config_from_args(args)).build_model(
    ProcessGroupCollection.use_mpu_process_groups()
)
print("BUILT auto", type(model.decoder.layers[0].self_attention.core_attention).__name__)
args.abft_attention = "flash"
for dropout in (0.1, 0.0):  # Megatron-LM's default attention dropout, then none
    args.attention_dropout = dropout
    try:
        model = GPTModelBuilder(gpt_config_from_args(args)).build_model(
            ProcessGroupCollection.use_mpu_process_groups()
        )
        print("BUILT flash", type(model.decoder.layers[0].self_attention.core_attention).__name__)
    except ValueError as error:
        print("REFUSED", "--attention-dropout 0" in str(error))
"""


MEGATRON_LM_BAD = [
    (["--transformer-impl", "transformer_engine"], "--transformer-impl transformer_engine: the "
     "protected layers are Megatron-core's local ones; add --transformer-impl local"),
    (["--fp8-format", "hybrid"], "--fp8-format hybrid: FP8 GEMMs are not protected"),
    (["--context-parallel-size", "2"], "--context-parallel-size 2: its ring attention"),
    (["--hybrid-layer-pattern", "M*M*"], "--hybrid-layer-pattern M*M*: HybridModel is not "
     "protected"),
    (["--abft-attention", "flash"], "--abft-attention flash needs --attention-dropout 0 (it is "
     "0.1)"),  # Megatron-LM's default attention dropout
    (["--abft-inject", "section=grad_q,step=2"], "section=grad_q is not in the unfused attention"),
    (["--abft-on-uncorrectable", "rerun", "--rerun-mode", "disabled"], "--abft-on-uncorrectable "
     "rerun needs Megatron's rerun state machine"),
]  # fmt: skip


@pytest.mark.parametrize("flags, message", MEGATRON_LM_BAD, ids=[f[0] for f, _ in MEGATRON_LM_BAD])
def test_megatron_lm_refuses_at_parse_what_the_layers_cannot_run(flags, message, monkeypatch):
    """Megatron-LM's own parse_args with add_abft_args: one line on stderr and exit 2, before
    any rank starts (in-process: nothing but the parser runs)."""
    from mcore import MEGATRON_LM_FLAGS
    from megatron.training.arguments import parse_args

    from megatron_abft.megatron_lm import add_abft_args

    monkeypatch.delenv("RANK", raising=False)
    for extra, refused in ((flags, True), ([], False)):
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *MEGATRON_LM_FLAGS, "--abft", *extra])
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                parse_args(extra_args_provider=add_abft_args)
                code = 0
            except SystemExit as exit_:
                code = exit_.code
        lines = err.getvalue().splitlines()
        if refused:
            assert code == 2 and len(lines) == 1, lines
            assert lines[0].startswith("pretrain_gpt.py: error: ") and message in lines[0]
        else:  # the same launch without them, with Megatron-LM's default dropout: accepted
            assert code == 0 and not lines, lines


def test_megatron_lm_defaults_to_rerun_and_says_what_a_policy_does_there(monkeypatch, caplog):
    """Megatron-LM's loop makes no ABFT call: recompute and skip_step cannot act there."""
    from mcore import MEGATRON_LM_FLAGS
    from megatron.training.arguments import parse_args

    from megatron_abft.megatron_lm import add_abft_args

    policies = {}
    for flags in (
        [], ["--rerun-mode", "disabled"], ["--abft-on-uncorrectable", "skip_step"],
        ["--abft-on-uncorrectable=log"],
    ):  # fmt: skip
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *MEGATRON_LM_FLAGS, "--abft", *flags])
        policies[" ".join(flags)] = parse_args(
            extra_args_provider=add_abft_args
        ).abft_on_uncorrectable
    assert policies == {
        "": "rerun",
        "--rerun-mode disabled": "raise",
        "--abft-on-uncorrectable skip_step": "skip_step",
        "--abft-on-uncorrectable=log": "log",
    }
    said = [r.getMessage() for r in caplog.records if r.name == "megatron_abft.flags"]
    assert said == [
        "[abft] --abft-on-uncorrectable skip_step: Megatron-LM's loop cannot recompute a GEMM or "
        "skip a step for ABFT, so an uncorrectable fault raises; rerun hands it to Megatron's "
        "rerun state machine"
    ]


def test_megatron_lm_builds_the_protected_model_from_its_flags_and_spec(tmp_path):
    """1 process: Megatron-LM 0.19's own argument parser with add_abft_args as its
    extra_args_provider, and its GPTModelBuilder with --spec megatron_abft.megatron_lm
    get_gpt_layer_abft_spec, build the protected attention (and Megatron's with --no-abft)."""
    from mcore import MEGATRON_LM_FLAGS, free_port

    port = str(free_port())
    script = tmp_path / "megatron_lm.py"
    script.write_text(MEGATRON_LM)
    flags = [
        *MEGATRON_LM_FLAGS, "--abft", "--abft-on-uncorrectable", "skip_step",
        "--abft-inject", "section=scores,layer=1,kind=nan,step=3",
    ]  # fmt: skip
    done = subprocess.run(
        [sys.executable, str(script), port, *flags],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    built = [
        line
        for line in done.stdout.splitlines()
        if line.startswith(("BUILT", "POLICY", "REFUSED", "INFO:megatron_abft.spec:"))
    ]
    assert built == [
        "POLICY skip_step scores",
        "INFO:megatron_abft.spec:[abft] attention=auto: ProtectedDotProductAttention, since no GPU "
        "here compiles the flash kernels",
        "BUILT True ProtectedDotProductAttention ProtectedColumnParallelLinear",
        "BUILT False DotProductAttention ColumnParallelLinear",
        "INFO:megatron_abft.spec:[abft] attention=auto: ProtectedDotProductAttention, since "
        "attention dropout (0.1) is not supported by the flash kernels",
        "BUILT auto ProtectedDotProductAttention",  # the README's launch line, on a GPU
        "REFUSED True",
        "BUILT flash ProtectedFlashAttention",
    ]
