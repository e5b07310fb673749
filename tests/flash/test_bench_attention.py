"""tools/bench_attention.py at its CPU shape (the flash kernels in Triton's interpreter): every
implementation gets a timed row that agrees with the fp32 reference, the JSON holds the
environment, and the protected flash attention computes what its unchecked kernels do."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import triton

from bench import attention as bench

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_run_times_every_implementation(tmp_path):
    out = tmp_path / "attention.json"
    argv = ["--json", str(out), "--repeats", "2", "--warmup", "1"]
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())

    env = result["environment"]
    assert env["device"] == "cpu" and env["driver"] is None
    assert env["torch"] == torch.__version__ and env["triton"] == triton.__version__
    assert env["cuda"] == torch.version.cuda
    assert env["command"] == ["python", "-m", "tools.bench_attention", *argv]
    assert result["settings"] == {"repeats": 2, "warmup": 1}

    rows = {row["implementation"]: row for row in result["rows"]}
    assert list(rows) == list(bench.CPU_IMPLEMENTATIONS)
    case = bench.CPU_CASE
    flops = 4 * case.batch * case.heads * case.seq**2 * case.head_dim / 2  # causal
    for name, row in rows.items():
        assert row["status"] == "ok", (name, row["note"])
        shape = tuple(row[k] for k in ("batch", "heads", "kv_heads", "seq", "head_dim"))
        assert shape == (1, 2, 1, 64, 64) and row["dtype"] == "bf16", name
        assert row["fwd_ms"] > 0 and row["fwd_bwd_ms"] > 0, name
        # on the CPU the host's time is the call's: the same calls, timed by the same clock
        assert 0.5 * row["fwd_bwd_ms"] < row["fwd_bwd_host_ms"] < 2 * row["fwd_bwd_ms"], name
        assert math.isfinite(row["tflops_fwd_bwd"]) and row["tflops_fwd_bwd"] > 0, name
        assert math.isclose(row["tflops_fwd_bwd"], 3.5 * flops / row["fwd_bwd_ms"] / 1e9)
        assert math.isclose(row["tflops_fwd"], flops / row["fwd_ms"] / 1e9)
        assert row["peak_mib"] is None  # CPU: no allocator statistics
        # bf16 against fp32: rounding, but no more than the dtype's tolerance
        assert 0 < row["max_error"] <= row["tolerance"] == 2**-4, name
    # the checks ran, over clean inputs: nothing flagged
    for name in ("flash", "protected_unfused", "protected_unfused_checked_gemm"):
        assert rows[name]["detected"] == 0, name
    assert rows["flash_unchecked"]["detected"] is None


def test_flash_checked_and_unchecked_agree():
    """The checks read the tiles and change nothing when they find nothing: the same output
    and gradients, bit for bit, as the kernels with the checks compiled out."""
    case = bench.CPU_CASE
    data = bench.inputs(case, torch.device("cpu"))
    results = []
    for name in ("flash", "flash_unchecked"):
        run = bench.setup(name, case, *data)
        out = run.forward()
        grads = torch.autograd.grad(out, run.leaves, run.grad)
        results.append((out.detach(), *grads))
    for checked, unchecked in zip(*results, strict=True):
        assert torch.equal(checked, unchecked)


def test_a_wrong_answer_fails_and_a_refusal_does_not(tmp_path, monkeypatch):
    """With a tolerance no bf16 output meets, the math backend's row is "wrong" and the exit
    code 1; cuDNN's backend refuses CPU tensors, which is a note, not a failure."""
    monkeypatch.setitem(bench.TOLERANCE, torch.bfloat16, 1e-6)
    out = tmp_path / "attention.json"
    argv = ["--json", str(out), "--implementations", "sdpa_math", "sdpa_cudnn", "--repeats", "1"]
    assert bench.main(argv) == 1
    wrong, refused = json.loads(out.read_text())["rows"]
    assert wrong["status"] == "wrong" and wrong["max_error"] > 1e-6 and wrong["fwd_ms"] > 0
    assert refused["status"] == "refused" and refused["note"] and refused["fwd_ms"] is None


def test_gpu_shapes_come_from_the_catalogue_and_configs():
    """Per-rank heads and KV heads (CATALOGUE's TP), head dim, and the configs' micro-batch."""
    cases = bench.gpu_cases(["GPT-3 350M", "GPT-3 1.3B", "Llama-2 7B"], [1024, 16384])
    shapes = [(c.model, c.batch, c.heads, c.kv_heads, c.seq, c.head_dim) for c in cases]
    assert shapes == [
        ("GPT-3 350M", 4, 16, 16, 1024, 64),
        ("GPT-3 350M", 4, 16, 16, 16384, 64),
        ("GPT-3 1.3B", 4, 16, 16, 1024, 128),
        ("GPT-3 1.3B", 4, 16, 16, 16384, 128),
        ("Llama-2 7B", 1, 16, 16, 1024, 128),
        ("Llama-2 7B", 1, 16, 16, 16384, 128),
    ]
    assert all(c.dtype == torch.bfloat16 and c.causal for c in cases)


def test_a_gpu_run_sets_each_kernels_checked_time_beside_its_unchecked():
    """kernel_lines pairs a case's checked and unchecked flash rows kernel by kernel (a kernel
    only the checked call launches against 0), the largest difference first, and leaves out
    cases with one of the two and rows whose profile failed."""

    def row(implementation, kernels, seq=2048):
        return {"model": "m", "seq": seq, "implementation": implementation, "kernels": kernels}

    rows = [
        row("flash", {"_fwd_kernel": {"us": 10.0}, "_sums_kernel": {"us": 3.0}}),
        row("flash_unchecked", {"_fwd_kernel": {"us": 8.0}}),
        row("sdpa_flash", None),
        row("flash", {"_fwd_kernel": {"us": 1.0}}, seq=8192),
        row("flash_unchecked", {"error": "RuntimeError: no profiler"}, seq=8192),
    ]
    lines = bench.kernel_lines(rows)
    assert lines[0].strip() == "m, seq 2048: device us a call, checked / unchecked"
    assert [line.split()[0] for line in lines[1:]] == ["_sums_kernel", "_fwd_kernel"]
    assert lines[1].split()[1:] == ["3.0", "/", "0.0"]
