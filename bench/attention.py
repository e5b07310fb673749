"""Time attention implementations, forward and backward, against the protected flash attention.

The protected flash attention (megatron_abft.flash) against the same kernels with the checks
compiled out, PyTorch's SDPA backends, and Megatron-core's unfused attention, protected (its
GEMMs checked after them, or by the checked GEMM) and not.

    python -m tools.bench_attention [--json PATH] [--models NAME ...] [--seqs N ...]
                                    [--repeats N] [--warmup N] [--implementations NAME ...]

For each model's attention on one tensor-parallel rank (heads, KV heads and head dim from
megatron_abft.tuning.shapes.CATALOGUE, micro-batch from its configs/ file) and sequence length,
every implementation's median forward and forward+backward times (CUDA events on a GPU,
perf_counter on CPU) and the host's time to return from a forward+backward call, the device
idle before it (where it nears the device's, the host bounds the call), its TFLOP/s (causal:
forward 4 B H N^2 D / 2, backward 2.5x that), its peak memory beyond the inputs, and its
forward's largest error against an fp32 reference: a benchmark of a wrong answer is worthless.
On a GPU: causal bf16 at 1k to 16k tokens, and the flash call's device time split by kernel,
checked against unchecked; without one, one tiny shape (the flash kernels in Triton's
interpreter), so that the tool and its test keep working.
An implementation that runs out of memory is recorded as "oom", a backend that refuses the
shape as "refused"; the exit code is 1 when an implementation failed or its error is too large.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import yaml
from torch import Tensor

from bench.timing import Timer, device_kernels
from megatron_abft.config import DTYPE_NAMES
from megatron_abft.tuning.shapes import CATALOGUE

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {
    "GPT-3 350M": "configs/gpt3_350m.yaml",
    "GPT-3 1.3B": "configs/gpt3_1.3b.yaml",
    "Llama-2 7B": "configs/llama2_7b.yaml",
}
"""The models benchmarked by default, and the training config that gives each its micro-batch."""
GPU_SEQS = (1024, 2048, 4096, 8192, 16384)
FLASH = ("flash", "flash_unchecked")
"""The implementations whose kernels are ours: a GPU run splits their time by kernel."""
GPU_IMPLEMENTATIONS = (
    "flash",
    "flash_unchecked",
    "sdpa_flash",
    "sdpa_cudnn",
    "megatron_unfused",
    "protected_unfused",
    "protected_unfused_checked_gemm",
)
CPU_IMPLEMENTATIONS = (
    "flash",
    "flash_unchecked",
    "sdpa_math",
    "megatron_unfused",
    "protected_unfused",
    "protected_unfused_checked_gemm",
)
IMPLEMENTATIONS = (*GPU_IMPLEMENTATIONS, "sdpa_math")
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2**-4, torch.float16: 2**-7}
"""Largest accepted |output - fp32 reference| for unit-normal q, k, v: 2.5x the worst error of
Megatron's unfused attention, which rounds S and P to the input dtype (0.025 in bf16 over 256
heads of 256 queries; flash attention rounds only P and O, and errs half as much)."""
MEGATRON = ("megatron_unfused", "protected_unfused", "protected_unfused_checked_gemm")


@dataclass(frozen=True)
class Case:
    """One attention call's shape: q [batch, heads, seq, head_dim], k and v with kv_heads."""

    model: str
    batch: int
    heads: int
    kv_heads: int
    seq: int
    head_dim: int
    dtype: torch.dtype
    causal: bool = True

    def flops(self) -> float:
        """Forward FLOPs: two GEMMs of 2 B H N^2 D each, half of them masked when causal."""
        total = 4 * self.batch * self.heads * self.seq**2 * self.head_dim
        return total / 2 if self.causal else total


CPU_CASE = Case("tiny (CPU)", 1, 2, 1, 64, 64, torch.bfloat16)
"""The one CPU shape: GQA, small enough for Triton's interpreter."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=None, help="write every row and the environment")
    p.add_argument(
        "--models",
        nargs="+",
        choices=[m.name for m in CATALOGUE],
        default=list(CONFIGS),
        metavar="NAME",
        help="GPU only: names in megatron_abft.tuning.shapes.CATALOGUE "
        f"(default: {', '.join(CONFIGS)})",
    )
    p.add_argument(
        "--seqs", nargs="+", type=int, default=list(GPU_SEQS), metavar="N", help="GPU only"
    )
    p.add_argument("--repeats", type=int, default=None, help="timed runs (default GPU 20, CPU 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed runs (default GPU 5, CPU 1)")
    p.add_argument(
        "--implementations",
        nargs="+",
        choices=IMPLEMENTATIONS,
        default=None,
        metavar="NAME",
        help=f"of {', '.join(IMPLEMENTATIONS)}; default on a GPU all but sdpa_math, on CPU "
        "sdpa_math for the sdpa rows",
    )
    return p.parse_args(argv)


def micro_batch(model: str) -> int:
    """The model's micro-batch in its training config (1 for a model without one)."""
    if model not in CONFIGS:
        return 1
    config = yaml.safe_load((ROOT / CONFIGS[model]).read_text())
    return int(config["training"]["micro-batch-size"])


def gpu_cases(models: list[str], seqs: list[int]) -> list[Case]:
    """Each model's attention on one tensor-parallel rank, at each sequence length, bf16."""
    shapes = {m.name: m for m in CATALOGUE}
    cases = []
    for name in models:
        shape = shapes[name]
        heads, kv_heads = shape.heads // shape.tp, max(shape.groups // shape.tp, 1)
        batch = micro_batch(name)
        for seq in seqs:
            cases.append(Case(name, batch, heads, kv_heads, seq, shape.head_dim, torch.bfloat16))
    return cases


class Refused(Exception):
    """A backend that does not take this shape, dtype or device."""


@dataclass
class Run:
    """One implementation set up on a case's inputs, in its own layout."""

    forward: Callable[[], Tensor]
    leaves: tuple[Tensor, ...]
    """The inputs the backward differentiates for."""
    grad: Tensor
    """The upstream gradient, shaped as the output."""
    to_bhsd: Callable[[Tensor], Tensor]
    """The output as [batch, heads, seq, head_dim]."""
    detected: Callable[[], int] | None = None
    """Matrices the checks flagged so far (none expected: the inputs are clean)."""
    note: str | None = None

    def forward_backward(self) -> None:
        torch.autograd.grad(self.forward(), self.leaves, self.grad)


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0]


def leaves(*tensors: Tensor) -> tuple[Tensor, ...]:
    return tuple(t.detach().clone().requires_grad_() for t in tensors)


def flash_run(case: Case, q: Tensor, k: Tensor, v: Tensor, do: Tensor, checked: bool) -> Run:
    """megatron_abft.flash.flash_attention, every section checked or the checks compiled out;
    its findings in a ledger of its own."""
    from megatron_abft.flash import FlashLedger, flash_attention

    ledger = FlashLedger.on(q.device)
    options = {} if checked else {"sections": ()}
    q, k, v = leaves(q, k, v)

    def forward() -> Tensor:
        return flash_attention(q, k, v, causal=case.causal, ledger=ledger, **options)

    def detected() -> int:
        return int(ledger.counts[:, 0].sum())

    return Run(forward, (q, k, v), do, lambda o: o, detected if checked else None)


def sdpa_run(case: Case, q: Tensor, k: Tensor, v: Tensor, do: Tensor, backend: str) -> Run:
    """torch's scaled_dot_product_attention held to one backend; GQA by enable_gqa, or by
    repeating K and V where the backend refuses that. Refused where it takes neither."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    if not hasattr(SDPBackend, backend):
        raise Refused(f"this torch has no SDPBackend.{backend}")
    chosen = getattr(SDPBackend, backend)
    q, k, v = leaves(q, k, v)
    rep = case.heads // case.kv_heads

    def grouped() -> Tensor:
        with sdpa_kernel(chosen):
            return sdpa(q, k, v, is_causal=case.causal, enable_gqa=rep > 1)

    def repeated() -> Tensor:
        k_rep, v_rep = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        with sdpa_kernel(chosen):
            return sdpa(q, k_rep, v_rep, is_causal=case.causal)

    reasons: dict[str, None] = {}  # ordered, without repeats
    for forward in (grouped, repeated) if rep > 1 else (grouped,):
        with warnings.catch_warnings(record=True) as caught:  # a GPU backend warns its reasons
            warnings.simplefilter("always")
            try:
                forward()
            except torch.cuda.OutOfMemoryError:  # a RuntimeError, but not a refusal
                raise
            except RuntimeError as error:  # "No available kernel" or "No viable backend"
                reasons.update(dict.fromkeys(str(w.message).strip() for w in caught))
                reasons[first_line(error)] = None
                continue
        note = "K, V repeated: enable_gqa refused" if forward is repeated else None
        return Run(forward, (q, k, v), do, lambda o: o, note=note)
    raise Refused("; ".join(reasons))


def megatron_run(
    case: Case, q: Tensor, k: Tensor, v: Tensor, do: Tensor, protected: bool, checked_gemm: bool
) -> Run:
    """Megatron-core's DotProductAttention, or this project's ProtectedDotProductAttention (its
    GEMMs by the checked GEMM with ``checked_gemm``), as a TP=1 GPT layer builds it: inputs
    [seq, batch, heads, head_dim], output [seq, batch, heads * head_dim]; the causal mask None
    (Megatron makes its own)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_abft.config import ABFTConfig
    from megatron_abft.layers.attention import ProtectedDotProductAttention
    from megatron_abft.runtime.guard import stats

    config = TransformerConfig(
        num_layers=1,
        hidden_size=case.heads * case.head_dim,
        num_attention_heads=case.heads,
        num_query_groups=case.kv_heads,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        params_dtype=case.dtype,
        bf16=case.dtype == torch.bfloat16,
        fp16=case.dtype == torch.float16,
        use_cpu_initialization=q.device.type == "cpu",
    )
    common = dict(layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    if protected:
        abft = ABFTConfig(checked_gemm=checked_gemm)
        module = ProtectedDotProductAttention(config, **common, abft_config=abft)
    else:
        module = DotProductAttention(config, **common)
    q, k, v = leaves(*(t.permute(2, 0, 1, 3).contiguous() for t in (q, k, v)))
    s, b = case.seq, case.batch
    grad = do.permute(2, 0, 1, 3).reshape(s, b, -1).contiguous()

    def detected() -> int:
        return sum(sum(counts["detected"].values()) for counts in stats(module).values())

    return Run(
        lambda: module(q, k, v, attention_mask=None),
        (q, k, v),
        grad,
        lambda o: o.view(s, b, case.heads, case.head_dim).permute(1, 2, 0, 3),
        detected if protected else None,
    )


def setup(name: str, case: Case, q: Tensor, k: Tensor, v: Tensor, do: Tensor) -> Run:
    if name in ("flash", "flash_unchecked"):
        return flash_run(case, q, k, v, do, checked=name == "flash")
    if name.startswith("sdpa_"):
        backend = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "math": "MATH"}
        return sdpa_run(case, q, k, v, do, backend[name.removeprefix("sdpa_")])
    protected = name.startswith("protected_unfused")
    return megatron_run(case, q, k, v, do, protected, name.endswith("_checked_gemm"))


def inputs(case: Case, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """q, k, v and the upstream gradient, unit normal, in the case's dtype: [b, h, s, d]."""
    g = torch.Generator(device).manual_seed(0)

    def randn(heads: int) -> Tensor:
        shape = (case.batch, heads, case.seq, case.head_dim)
        return torch.randn(shape, generator=g, device=device).to(case.dtype)

    return randn(case.heads), randn(case.kv_heads), randn(case.kv_heads), randn(case.heads)


def reference(case: Case, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """softmax(q k^T / sqrt(d)) v in fp32 by plain ops, one (batch, head) at a time so that
    one [seq, seq] matrix is live at once."""
    rep = case.heads // case.kv_heads
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    mask = None
    if case.causal:
        mask = torch.ones(case.seq, case.seq, dtype=torch.bool, device=q.device).triu(1)
    for b in range(case.batch):
        for h in range(case.heads):
            s = (q[b, h].float() @ k[b, h // rep].float().T) / math.sqrt(case.head_dim)
            if mask is not None:
                s.masked_fill_(mask, -math.inf)
            out[b, h] = torch.softmax(s, dim=-1) @ v[b, h // rep].float()
    return out


def allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def measure(
    name: str, case: Case, data: tuple, ref: Tensor, args: argparse.Namespace, device: torch.device
) -> dict:
    """One row: times, TFLOP/s, peak memory and error of implementation ``name`` on ``case``;
    status "ok", "wrong" (error above tolerance), "oom", "refused" or "error"."""
    cuda = device.type == "cuda"
    row = {
        **{k: v for k, v in asdict(case).items() if k != "dtype"},
        "dtype": DTYPE_NAMES[case.dtype],
        "implementation": name,
        "status": "ok",
        "note": None,
        "fwd_ms": None,
        "fwd_bwd_ms": None,
        "fwd_bwd_host_ms": None,
        "tflops_fwd": None,
        "tflops_fwd_bwd": None,
        "peak_mib": None,
        "max_error": None,
        "tolerance": TOLERANCE[case.dtype],
        "detected": None,
    }
    try:
        run = setup(name, case, *data)
        row["note"] = run.note
        base = allocated(device)  # the inputs, in the implementation's layout
        row["max_error"] = float((run.to_bhsd(run.forward().detach()).float() - ref).abs().max())
        if row["max_error"] > row["tolerance"]:
            row["status"] = "wrong"
        for _ in range(args.warmup):
            run.forward_backward()
        forward, forward_backward, host = Timer(cuda), Timer(cuda), Timer(cuda=False)
        for _ in range(args.repeats):
            forward.time(run.forward)
        # the host's time to launch it too: near the device's, the host bounds the call (a
        # GPU's time then measures the launching). On the CPU the same calls' spans; on a GPU
        # calls of their own, the device idle before each (busy, its queue of launches could
        # hold the host back)
        for _ in range(args.repeats):
            forward_backward.time(
                run.forward_backward if cuda else lambda: host.time(run.forward_backward)
            )
        if cuda:
            for _ in range(args.repeats):
                torch.cuda.synchronize(device)
                host.time(run.forward_backward)
        row["fwd_ms"], row["fwd_bwd_ms"] = forward.median_ms(), forward_backward.median_ms()
        row["fwd_bwd_host_ms"] = host.median_ms()
        if cuda:  # one more run, from what the inputs and the implementation's state hold
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            run.forward_backward()
            row["peak_mib"] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
            if name in FLASH:  # where the call's device time goes, kernel by kernel
                row["kernels"] = device_kernels(run.forward_backward, device)
        if run.detected is not None:
            row["detected"] = run.detected()
    except torch.cuda.OutOfMemoryError:
        row["status"] = "oom"
    except Refused as error:
        row["status"], row["note"] = "refused", str(error)
    except Exception as error:  # noqa: BLE001 - one broken row must not end a GPU sweep
        row["status"], row["note"] = "error", f"{type(error).__name__}: {first_line(error)}"
    run = None
    if name in MEGATRON:  # the scores' buffer Megatron keeps: counted in this row, not the next
        from megatron.core import parallel_state

        parallel_state.destroy_global_memory_buffer()
        parallel_state._set_global_memory_buffer()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    flops = case.flops()
    if row["fwd_ms"] is not None:
        row["tflops_fwd"] = flops / (row["fwd_ms"] * 1e-3) / 1e12
        row["tflops_fwd_bwd"] = 3.5 * flops / (row["fwd_bwd_ms"] * 1e-3) / 1e12
    return row


def start_megatron(device: torch.device) -> Callable[[], None]:
    """Megatron's parallel state for this one process (TP=1): gloo on CPU (in CPU mode), NCCL on
    a GPU. Returns what undoes it (what was there before is kept)."""
    from megatron.core import parallel_state, tensor_parallel

    if device.type == "cpu":
        from megatron_abft.cpu import enable_cpu_mode

        enable_cpu_mode()
    group = not torch.distributed.is_initialized()
    if group:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        backend = "nccl" if device.type == "cuda" else "gloo"
        torch.distributed.init_process_group(backend, rank=0, world_size=1)
    model_parallel = not parallel_state.model_parallel_is_initialized()
    if model_parallel:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)

    def stop() -> None:
        if model_parallel:
            parallel_state.destroy_model_parallel()
        if group:
            torch.distributed.destroy_process_group()

    return stop


def driver_version() -> str | None:
    """The NVIDIA driver, from nvidia-smi where there is one."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        out = subprocess.run(query, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None


def environment(device: torch.device, argv: list[str]) -> dict:
    import triton

    cuda = device.type == "cuda"
    return {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "driver": driver_version() if cuda else None,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "command": ["python", "-m", "tools.bench_attention", *argv],
    }


COLUMNS = (
    "model",
    "seq",
    "implementation",
    "fwd ms",
    "fwd+bwd ms",
    "host ms",
    "TFLOP/s fwd+bwd",
    "peak MiB",
    "max error",
    "status",
)


def table_line(row: dict) -> str:
    def num(value, digits: int) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    status = row["status"] if row["note"] is None else f"{row['status']}: {row['note']}"
    cells = (
        row["model"],
        str(row["seq"]),
        row["implementation"],
        num(row["fwd_ms"], 3),
        num(row["fwd_bwd_ms"], 3),
        num(row["fwd_bwd_host_ms"], 3),
        "-" if row["tflops_fwd_bwd"] is None else f"{row['tflops_fwd_bwd']:.3g}",
        num(row["peak_mib"], 1),
        "-" if row["max_error"] is None else f"{row['max_error']:.1e}",
        status,
    )
    return "| " + " | ".join(cells) + " |"


def kernel_lines(rows: list[dict]) -> list[str]:
    """For each case the flash call ran checked and unchecked on a GPU: each kernel's device
    microseconds a call (its launches summed, the retries with their kernel), checked against
    unchecked, the largest difference first."""

    def us(table: dict, name: str) -> float:
        return table.get(name, {}).get("us", 0.0)

    lines = []
    cases: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        if isinstance(row.get("kernels"), dict) and "error" not in row["kernels"]:
            cases.setdefault((row["model"], row["seq"]), {})[row["implementation"]] = row["kernels"]
    for (model, seq), found in cases.items():
        checked, unchecked = found.get("flash"), found.get("flash_unchecked")
        if checked is None or unchecked is None:
            continue
        lines.append(f"\n{model}, seq {seq}: device us a call, checked / unchecked")
        names = set(checked) | set(unchecked)
        for name in sorted(names, key=lambda n: us(unchecked, n) - us(checked, n)):
            lines.append(f"  {name[:60]:<60} {us(checked, name):9.1f} / {us(unchecked, name):9.1f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if cuda:
        cases = gpu_cases(args.models, args.seqs)
        names = args.implementations or list(GPU_IMPLEMENTATIONS)
    else:
        if "--models" in argv or "--seqs" in argv:
            print("no GPU: --models and --seqs ignored; one tiny shape instead", file=sys.stderr)
        cases = [CPU_CASE]
        names = args.implementations or list(CPU_IMPLEMENTATIONS)
    args.repeats = args.repeats or (20 if cuda else 3)
    args.warmup = args.warmup if args.warmup is not None else (5 if cuda else 1)
    env = environment(device, argv)
    stop = start_megatron(device) if set(names) & set(MEGATRON) else None

    print(f"{env['device']}, torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}")
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS), flush=True)
    rows = []
    try:
        for case in cases:
            data = inputs(case, device)
            ref = reference(case, *data[:3])
            for name in names:
                rows.append(measure(name, case, data, ref, args, device))
                print(table_line(rows[-1]), flush=True)
            del data, ref
    finally:
        if stop is not None:
            stop()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        settings = {"repeats": args.repeats, "warmup": args.warmup}
        result = {"environment": env, "settings": settings, "rows": rows}
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    for line in kernel_lines(rows):
        print(line)
    failed = [r for r in rows if r["status"] in ("error", "wrong")]
    for row in failed:
        where = f"{row['implementation']} at {row['model']}, seq {row['seq']}"
        why = row["note"] or f"max error {row['max_error']:.2e} > {row['tolerance']:.2e}"
        print(f"{where}: {row['status']} ({why})", file=sys.stderr)
    return 1 if failed else 0
