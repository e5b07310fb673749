"""Never silent with no loop edits: a training loop that makes no ABFT call still sees every
uncorrectable fault raised, re-run or at least printed and written to the events file
(megatron_abft.runtime.model_runtime).

The fault is a NaN in layer 1's softmax output on tensor-parallel rank 1 (section ``probs``):
it sits in the context GEMM's input, so neither correction nor a recompute can remove it."""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mcore import MEGATRON_LM_FLAGS, Shape, build_gpt, free_port, loss_and_grads, spawn

from megatron_abft import Fault
from megatron_abft.config import POLICIES, ABFTConfig

ROOT = Path(__file__).resolve().parents[2]
SHAPE = Shape(heads=4, groups=2)
PROBS_NAN = Fault("probs", "nan", layer=1, tp_rank=1, seed=2)
LOUD = "!!! ABFT UNCORRECTABLE FAULT !!! Rank 1"


def _plain_loop_worker(policies):
    """Three forward/backward passes per policy, the fault in the second; the loop calls
    nothing of megatron_abft but ``inject``, which stands in for the soft error."""
    from megatron_abft import ABFTUncorrectableError, inject
    from megatron_abft.spec import get_gpt_layer_abft_spec

    out = {}
    for policy in policies:
        model = build_gpt(SHAPE, get_gpt_layer_abft_spec(ABFTConfig(on_uncorrectable=policy)))
        err, raised = io.StringIO(), None
        with contextlib.redirect_stderr(err):
            for step in range(3):
                try:
                    with inject(model, [PROBS_NAN] if step == 1 else []):
                        loss_and_grads(model, SHAPE, step)
                except ABFTUncorrectableError as error:
                    raised = (step, str(error))
                    break
        events = [json.loads(line) for line in Path("abft_events.jsonl").read_text().splitlines()]
        out[policy] = {
            "raised": raised,
            "stderr": err.getvalue(),
            "events": [e for e in events if e["policy"] == policy],
        }
    return out


def test_a_loop_that_makes_no_abft_call_is_never_silent():
    """Spawns 2 ranks. Under every policy the fault is printed with rank, layer, section and
    step and written to the default events file; every policy but ``log`` raises at the next
    pass's first protected forward (nothing else can act for the loop: there is no step to
    skip or re-run without it); ``log`` trains on."""
    ranks = spawn(2, 2, _plain_loop_worker, POLICIES)
    for rank in ranks:
        if isinstance(rank, Exception):
            raise rank
    for policy in POLICIES:
        faulty = ranks[1][policy]
        assert (
            f"{LOUD}, node {socket.gethostname()}, iteration 1: layer 1 section context"
            in (faulty["stderr"])
        ), policy
        assert {
            "rank": 1,
            "tp_rank": 1,
            "layer": 1,
            "section": "context",
            "step": 1,
            "action": "uncorrectable",
            "policy": policy,
        } in faulty["events"]
        if policy == "log":
            assert faulty["raised"] is None
        else:
            step, message = faulty["raised"]
            assert step == 2 and "rank 1 layer 1 section context step 1" in message, policy


def _abft_object_worker():
    """A loop that holds one ABFT: the fault of step 2 is skipped by the policy, counted and
    written to the telemetry's events file; a disabled model's object does nothing."""
    from megatron_abft import ABFT, inject
    from megatron_abft.runtime.telemetry import TelemetryConfig
    from megatron_abft.spec import get_gpt_layer_abft_spec

    model = build_gpt(SHAPE, get_gpt_layer_abft_spec(ABFTConfig(on_uncorrectable="skip_step")))
    abft = ABFT(model, TelemetryConfig(events_file="events.jsonl", policy="skip_step"))
    actions, err = [], io.StringIO()
    with contextlib.redirect_stderr(err):
        for step in (1, 2, 3):
            abft.step_begin(step)
            with inject(model, [PROBS_NAN] if step == 2 else []) as landed:
                loss_and_grads(model, SHAPE, step)
            abft.count_injected(len(landed))
            actions.append(abft.step_end().action)
        abft.log(3)
    abft.close()
    uncorrectable = sum(abft.stats()["context"]["uncorrectable"].values())
    events = []  # the logging rank's file (the last rank), made with its first event
    if torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
        events = [json.loads(line) for line in Path("events.jsonl").read_text().splitlines()]
    off = build_gpt(SHAPE, get_gpt_layer_abft_spec(ABFTConfig(enabled=False)))
    disabled = ABFT(off)
    disabled.step_begin(1)
    loss_and_grads(off, SHAPE)
    return {
        "actions": actions,
        "uncorrectable": uncorrectable,
        "events": [(e["step"], e["layer"], e["section"], e["action"]) for e in events],
        "stderr": err.getvalue(),
        "disabled": (disabled.telemetry, disabled.step_end().action),
    }


def test_one_abft_object_drives_a_loop():
    """Spawns 2 ranks: step_begin, step_end (every rank skips step 2), log and close."""
    ranks = spawn(2, 2, _abft_object_worker)
    for rank in ranks:
        if isinstance(rank, Exception):
            raise rank
        assert rank["actions"] == ["none", "skip_step", "none"]
        assert rank["disabled"] == (None, "none")
    faulty = ranks[1]
    assert faulty["uncorrectable"] >= 1
    assert (
        "iteration 2: layer 1 section context; policy skip_step: the step is skipped"
        in (faulty["stderr"])
    )
    # the logging rank (the last) writes every rank's events
    assert (2, 1, "context", "uncorrectable") in ranks[1]["events"]


def _sparse_interval_worker():
    from megatron_abft.spec import get_gpt_layer_abft_spec

    model = build_gpt(SHAPE, get_gpt_layer_abft_spec(ABFTConfig(check_interval=2)))
    layers = [
        (layer.layer_number, guard.layer, guard.section)
        for layer in model.decoder.layers
        for module in layer.self_attention.modules()
        for guard in getattr(module, "abft_guards", ())
    ]
    loss_and_grads(model, SHAPE)
    try:
        loss_and_grads(model, SHAPE)
    except RuntimeError as error:
        return {"layers": layers, "refused": str(error)}
    return {"layers": layers, "refused": None}


def test_check_intervals_without_a_known_step_are_refused():
    """Check intervals need the training step: where the loop gives none and no Megatron-LM
    iteration is there, the second pass refuses instead of checking by pass count. Before any
    walk of the model, every guard knows its Megatron layer (what the runtime prints)."""
    for rank in spawn(2, 2, _sparse_interval_worker):
        assert rank["refused"] is not None and "need the training step" in rank["refused"]
        assert "set_step(model, iteration)" in rank["refused"]
        assert len(rank["layers"]) == 2 * 4  # qkv, scores, context, proj
        assert all(number == layer for number, layer, _ in rank["layers"])


MEGATRON_LM_LOOP = """
import os, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
from megatron_abft.cpu import enable_cpu_mode
enable_cpu_mode()
import torch
torch.distributed.init_process_group("gloo", rank=0, world_size=1)
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.rerun_state_machine import (
    RerunDataIterator, RerunMode, initialize_rerun_state_machine,
)
from megatron.training import global_vars
from megatron.training.argument_utils import gpt_config_from_args
from megatron.training.arguments import parse_args, validate_args
from megatron.training.models.gpt import GPTModelBuilder
from megatron.training.training import (
    get_megatron_ddp_config, get_megatron_optimizer_config, get_optimizer_param_scheduler,
    train_step,
)
from megatron_abft import ABFT, ABFTUncorrectableError
from megatron_abft.megatron_lm import add_abft_args

parallel_state.initialize_model_parallel()
tensor_parallel.model_parallel_cuda_manual_seed(1234)
sys.argv = ["pretrain_gpt.py", *sys.argv[2:]]
args = parse_args(extra_args_provider=add_abft_args)
validate_args(args)
global_vars.set_global_variables(args, build_tokenizer=False)
initialize_rerun_state_machine(mode=RerunMode(args.rerun_mode))


class WandbWriter:  # Megatron-LM's W&B writer (get_wandb_writer), printing what it gets
    def log(self, scalars, step):
        shown = {k: scalars[k] for k in ("abft/detected", "abft/corrected", "abft/uncorrectable")}
        print("WANDB", step, shown, flush=True)


global_vars._GLOBAL_WANDB_WRITER = WandbWriter()
forwards = 0  # forward passes of the current step: 2 where Megatron re-ran it


def forward_step(data_iterator, model):
    global forwards
    forwards += 1
    tokens = next(data_iterator)
    output = model(tokens[:, :-1], torch.arange(32).expand(2, 32), None, labels=tokens[:, 1:])
    return output, lambda out: (out.float().mean(), {"lm loss": out.float().mean().detach()})


# Megatron-LM's setup_model_and_optimizer, less its moves to CUDA: the model in Megatron's DDP,
# Megatron's optimizer and LR schedule from the flags, the config as train() completes it.
gpt = GPTModelBuilder(gpt_config_from_args(args)).build_model(
    ProcessGroupCollection.use_mpu_process_groups()
)
model = DistributedDataParallel(gpt.config, get_megatron_ddp_config(args), gpt)
optimizer_config, overrides = get_megatron_optimizer_config(args)
optimizer = get_megatron_optimizer(optimizer_config, [model], overrides)
scheduler = get_optimizer_param_scheduler(optimizer)
config = gpt.config
config.grad_scale_func = optimizer.scale_loss
config.finalize_model_grads_func = finalize_model_grads
seeds = [torch.Generator().manual_seed(i) for i in range(8)]
data = RerunDataIterator(iter([torch.randint(0, 128, (2, 33), generator=g) for g in seeds]))
abft = ABFT(gpt) if os.environ.get("LOOP_CALLS") else None  # the optional loop calls
for iteration in range(5):  # Megatron-LM's train(), iteration from 0
    args.curr_iteration = iteration
    forwards = 0
    try:
        if abft:
            abft.step_begin(iteration + 1)
        done = train_step(forward_step, data, [model], optimizer, scheduler, config,
                          get_forward_backward_func(), iteration=iteration)
        if abft:
            assert abft.step_end().action == "none"
    except ABFTUncorrectableError as error:
        print("RAISED", iteration + 1, error, flush=True)
        break
    stop, code = done[3], done[4]
    print("STEP", iteration + 1, forwards, stop, code, flush=True)
    if stop:
        break
"""


def _megatron_lm(
    tmp_path: Path,
    *flags: str,
    loop_calls: bool = False,
    fault: str = "section=probs,layer=1,kind=nan,step=3,seed=2",
):
    port = str(free_port())
    script = tmp_path / "megatron_lm_loop.py"
    script.write_text(MEGATRON_LM_LOOP)
    model = [*MEGATRON_LM_FLAGS, "--attention-dropout", "0", "--abft", "--abft-inject", fault]
    env = {"CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    env["LOOP_CALLS"] = "1" if loop_calls else ""
    return subprocess.run(
        [sys.executable, str(script), port, *model, *flags],
        cwd=tmp_path, env={**os.environ, **env}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip


RERUN = ["STEP 1 1 False 0", "STEP 2 1 False 0", "STEP 3 2 True 17"]


@pytest.mark.parametrize(
    "policy, loop_calls, expected",
    [
        ("rerun", False, RERUN),
        ("raise", False, ["STEP 1 1 False 0", "STEP 2 1 False 0", "RAISED 3"]),
        ("rerun", True, RERUN),
    ],
    ids=["rerun", "raise", "rerun-with-step-calls"],
)
def test_megatron_lm_loop_with_the_flags_alone(tmp_path, policy, loop_calls, expected):
    """1 process: Megatron-LM's flags and spec, its own ``train_step`` (Megatron's DDP, optimizer
    and LR schedule, its rerun state machine and forward-backward), and a loop around it that
    makes no ABFT call. The runtime reads Megatron-LM's iteration, lands the
    ``--abft-inject`` fault at step 3, and settles it at the end of that step's backward: under
    ``rerun`` Megatron re-runs the step in place, the fault is gone (transient) and Megatron
    exits with its code 17; under ``raise`` the step raises. Printed and recorded either way.
    A loop that also calls ``ABFT.step_begin`` and ``step_end`` leaves rerun to the runtime."""
    done = _megatron_lm(tmp_path, "--abft-on-uncorrectable", policy, "--rerun-mode",
                        "validate_results", loop_calls=loop_calls)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith(("STEP", "RAISED"))]
    assert [line[: len(e)] for line, e in zip(lines, expected, strict=True)] == expected
    loud = "ERROR:megatron_abft.runtime.model_runtime:!!! ABFT UNCORRECTABLE FAULT !!! Rank 0"
    # on Megatron-LM's console: its logging set-up prints every logger's records on stdout
    assert f"{loud}, node {socket.gethostname()}, iteration 3: layer 1 section context" in (
        done.stdout
    )
    events = [json.loads(line) for line in (tmp_path / "abft_events.jsonl").open()]
    assert {(e["step"], e["layer"], e["section"], e["policy"]) for e in events} >= {
        (3, 1, "context", policy)
    }


def test_megatron_lm_telemetry_needs_no_loop_call(tmp_path):
    """Megatron-LM's flags alone, with ``--log-interval 2``: after the optimizer's step of every
    second step the runtime gathers the counters, prints Megatron-LM's log line with the ABFT
    counts and logs the ``abft/*`` scalars to Megatron-LM's W&B writer. The fault of step 3,
    INF in a scores element, is corrected in place and counted in the line of step 4."""
    done = _megatron_lm(tmp_path, "--log-interval", "2",
                        fault="section=scores,layer=2,kind=inf,step=3,seed=1")  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    counts = "abft injected/detected/corrected/uncorrectable"
    logged = [line for line in done.stdout.splitlines() if counts in line]
    assert len(logged) == 2, done.stdout[-3000:]
    assert logged[0].startswith(" iteration        2/") and f"{counts}: 0/0/0/0" in logged[0]
    assert logged[1].startswith(" iteration        4/") and f"{counts}: 0/1/1/0" in logged[1]
    wandb = [line for line in done.stdout.splitlines() if line.startswith("WANDB")]
    assert wandb == [
        "WANDB 2 {'abft/detected': 0.0, 'abft/corrected': 0.0, 'abft/uncorrectable': 0.0}",
        "WANDB 4 {'abft/detected': 1.0, 'abft/corrected': 1.0, 'abft/uncorrectable': 0.0}",
    ]
    assert "UNCORRECTABLE" not in done.stderr + done.stdout


def test_the_config_is_plain_data_and_its_runtime_lives_as_long_as_it():
    """ABFTConfig holds no runtime (every field is a setting); runtime_of gives one runtime a
    config while the config lives, and forgets it when the config and its layers go."""
    import dataclasses
    import gc

    from megatron_abft.runtime import model_runtime
    from megatron_abft.runtime.guard import SectionGuard

    config = ABFTConfig()
    fields = {f.name for f in dataclasses.fields(config)}
    assert not any(isinstance(v, model_runtime.Runtime) for v in vars(config).values())
    assert "runtime" not in fields
    runtime = model_runtime.runtime_of(config)
    assert model_runtime.runtime_of(config) is runtime
    assert model_runtime.runtime_of(ABFTConfig()) is not runtime
    layer = torch.nn.Linear(2, 2)
    layer.abft_guards = (SectionGuard("proj", config, 0),)
    runtime.attach(layer)
    assert runtime.config is config and list(runtime.guards()) == list(layer.abft_guards)
    key = id(config)
    del config, runtime, layer
    gc.collect()
    assert key not in model_runtime._RUNTIMES


def test_a_model_with_its_runtime_pickles():
    """torch.save of a whole module pickles its config, hooks and runtime (weak references
    inside): the copy's runtime holds the copy's guards."""
    import copy
    import pickle

    from megatron_abft.runtime.guard import SectionGuard
    from megatron_abft.runtime.model_runtime import runtime_of

    config = ABFTConfig()
    layer = torch.nn.Linear(2, 2)
    layer.abft_guards = (SectionGuard("proj", config, 0),)
    runtime_of(config).attach(layer)
    for twin in (pickle.loads(pickle.dumps(layer)), copy.deepcopy(layer)):
        runtime = runtime_of(twin.abft_guards[0].config)
        assert runtime is not runtime_of(config)
        assert list(runtime.guards()) == list(twin.abft_guards)
