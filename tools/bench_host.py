"""What protection costs the host on this machine: a guard's clean check against its op alone
(the difference is the Python around it), with warm caches and with cold ones, as in a training
step, and on a GPU the checked GEMM's call (megatron_abft.ops.checked_gemm) as the layers make
it; set_step and finish_step, which run once a step, and the telemetry's gather, once a log
interval, on a GPT model; and the protected flash attention's call, forward and backward. On a
GPU this is the host side of a step, which the GPU hides only while the host runs ahead of it;
the overhead model counts device time only (docs/benchmarks.md).

    python -m tools.bench_host --layers 24 --out host.json
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import socket
import statistics
import time
from pathlib import Path

import torch

from bench.timing import best_per_call, call_ms, device_kernels
from megatron_abft.check.checker import CompiledChecker, ReferenceChecker
from megatron_abft.check.eec import GemmOperands
from megatron_abft.config import ABFTConfig
from megatron_abft.ops import checked_gemm, compiled
from megatron_abft.runtime.guard import SectionGuard, iter_guards
from megatron_abft.runtime.telemetry import Telemetry

CHECK_CALLS, COLD_CALLS, STEP_CALLS, FLASH_CALLS = 2000, 300, 20, 200
"""Each timing's calls: a warm check's, one with cold caches, set_step's and finish_step's, the
flash attention's (``--calls`` scales them)."""


def per_call_cold(fn, device: torch.device, number: int = COLD_CALLS) -> float:
    """Median seconds of one call of ``fn`` with cold caches, as a check runs in a training step
    between other work: before each call, a 32 MiB copy and a small MLP's forward and backward
    (other data, other code)."""
    source = torch.randn(8 * 2**20, device=device)
    target = torch.empty_like(source)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.LayerNorm(256)).to(device)
    x = torch.randn(32, 64, device=device, requires_grad=True)
    times = []
    for _ in range(number):
        target.copy_(source)
        for _ in range(20):
            mlp(x).sum().backward()
        times.append(call_ms(fn, device) / 1e3)
    return statistics.median(times)


def clean_check(
    device: torch.device, number: int = CHECK_CALLS, cold: int = COLD_CALLS
) -> dict[str, float]:
    """A guard's clean check of a small GEMM with a bias, as the qkv projection's (32 tokens,
    hidden 64, 192 outputs: its time is all overhead), and what its checker runs for it called
    directly with the arguments the checker holds (megatron_abft.check.checker): the screen
    alone where the host reads results on the CPU (compiled.screen_passes), check_gemm and a
    read of the worst status elsewhere on the host's route, check_gemm_tally on a GPU's
    sync-free one."""
    g = torch.Generator().manual_seed(0)
    x, w, bias = (torch.randn(*s, generator=g).to(device) for s in ((32, 64), (192, 64), (192,)))
    operands, y = GemmOperands(x, w.t(), 1.0, bias), torch.addmm(bias, x, w.t())
    guard = SectionGuard("qkv", ABFTConfig(), 0)
    for _ in range(10):
        guard.check(y, operands)
    (plan,) = guard.checkers.values()
    if not isinstance(plan, CompiledChecker):
        raise RuntimeError("the compiled kernels do not serve this device: no compiled checker")
    ops, ledger = torch.ops.megatron_abft, guard.ledger
    arguments = (y, x, w.t(), 1.0, bias, plan.block, *plan.bounds, plan.near_inf, plan.capacity)

    def alone():
        if plan.host_screen:
            compiled.screen_passes(y, x, w.t(), 1.0, bias, plan.block, *plan.bounds, plan.capacity)
        elif plan.sync_free:
            ops.check_gemm_tally.default(*arguments, *compiled._ledger_args(ledger))
        else:
            int(ops.check_gemm.default(*arguments)[0])

    found = {
        "check": best_per_call(lambda: guard.check(y, operands), device, number),
        "ops_alone": best_per_call(alone, device, number),
        "check_cold": per_call_cold(lambda: guard.check(y, operands), device, cold),
        "ops_alone_cold": per_call_cold(alone, device, cold),
        "gemm_cold": per_call_cold(lambda: torch.addmm(bias, x, w.t()), device, cold),
    }
    if device.type == "cuda":  # the checked GEMM as the layers run it (bf16), against the GEMM
        x, w, bias = (t.bfloat16() for t in (x, w, bias))
        tile = checked_gemm.tiles_for(device)
        sums = checked_gemm.weight_sums(w, tile.block_n)

        def checked():
            _, codes = checked_gemm.checked_linear(x, w, bias, sums=sums)
            checked_gemm.tally(codes, w.shape[0], tile, ledger)

        found["checked_gemm"] = best_per_call(checked, device, number)
        found["gemm"] = best_per_call(lambda: torch.addmm(bias, x, w.t()), device, number)
    return found


def torch_calls(fn) -> dict[str, int]:
    """What one call of ``fn`` asks of torch (the profiler's record of a second call): its calls
    into ATen and the tensors it makes, the part of an op's host time that is torch's."""
    fn()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    names = [e.name for e in prof.events()]
    return {
        "aten_calls": sum(name.startswith("aten::") for name in names),
        "tensors": sum(name in ("aten::empty", "aten::empty_strided") for name in names),
    }


def sync_free_calls(device: torch.device) -> dict[str, int]:
    """torch_calls of the op of a sync-free check (a GPU's) of clean_check's GEMM, by the CUDA
    kernels: on a GPU, or on a CPU through the CUDA emulator (its counts only: the emulator's
    time is not a GPU's)."""
    g = torch.Generator().manual_seed(0)
    x, w, bias = (torch.randn(*s, generator=g).to(device) for s in ((32, 64), (192, 64), (192,)))
    y = torch.addmm(bias, x, w.t())
    guard = SectionGuard("qkv", ABFTConfig(), 0)
    emulated = device.type == "cpu"
    if emulated and not compiled.emulator_available():
        return {}
    with compiled.emulated_cuda() if emulated else contextlib.nullcontext():
        reference = ReferenceChecker(ABFTConfig(), sync_free=True)
        plan = CompiledChecker.make(y, GemmOperands(x, w.t(), 1.0, bias), None, reference)
        arguments = (y, x, w.t(), 1.0, bias, plan.block, *plan.bounds, plan.near_inf)
        ledger = compiled._ledger_args(guard.ledger_on(device))
        call = torch.ops.megatron_abft.check_gemm_tally.default
        return torch_calls(lambda: call(*arguments, plan.capacity, *ledger))


def per_step(layers: int, device: torch.device, number: int = STEP_CALLS) -> dict[str, float]:
    """set_step and finish_step, and the telemetry's gather (once a log interval), on a GPT
    model of ``layers`` protected layers (small ones: they walk the model's modules and its
    guards, whatever their size): the unfused attention's before any step, and (``flash``) the
    flash attention's after one (on the CPU the step runs in Triton's interpreter, a few
    seconds), as the loop makes them: finish_step after the layers ran (each layer's seven
    guards marked as its forward marks them, then read), set_step after finish_step (none
    read again)."""
    from bench.overhead import build_model, parse_args
    from megatron_abft import finish_step, set_step

    shape = ["--layers", str(layers), "--hidden", "64", "--heads", "4", "--seq", "32"]
    shape += ["--dtype", "bf16" if device.type == "cuda" else "fp32"]  # the flash kernels' own
    result = {}
    for attention in ("unfused", "flash"):
        args = parse_args([*shape, "--attention", attention])
        model = build_model(args, ABFTConfig(on_uncorrectable="log"))
        if attention == "flash":
            tokens = torch.zeros(1, args.seq, dtype=torch.long, device=device)
            positions = torch.arange(args.seq, device=device).unsqueeze(0)
            set_step(model, 0)
            model(tokens, positions, None, labels=tokens).float().mean().backward()
        steps = iter(range(1, 10**9))
        telemetry = Telemetry(model, stream=io.StringIO())
        in_kernels = [g for g in iter_guards(model) if g.in_kernel]

        def finish(model=model, in_kernels=in_kernels) -> None:
            for guard in in_kernels:  # as each flash layer's forward marks its guards
                guard.unread = True
            finish_step(model)

        result[attention] = {
            "modules": sum(1 for _ in model.modules()),
            "gather": best_per_call(lambda t=telemetry: t.gather(0), device, number),
            "set_step": best_per_call(
                lambda model=model, steps=steps: set_step(model, next(steps)), device, number
            ),
            "finish_step": best_per_call(finish, device, number),
        }
    return {**result.pop("unfused"), **result}


def flash_call(device: torch.device, number: int = FLASH_CALLS) -> dict[str, dict[str, float]]:
    """The host's time of one forward and backward of the protected flash attention, checked
    (every section) and unchecked (the checks compiled out), from the call until the backward
    returns, for GPT-3 350M's heads (16 of 64, head dim 64, bf16). On a GPU one sequence of
    2048 tokens, and each kernel's device time (``kernels``). On the CPU 128 tokens, the Triton
    launches counted and not run: the time is the Python and torch around them (and their
    count, the same on every device), and ``binder``, Triton's binder alone on the call's
    launches that take it on a GPU (aot.binder_seconds: the part of its launcher that grows with
    the arguments; a second, RETRY, launch goes straight to its compiled kernel, launch._twice),
    ``bound`` their count, and ``globals``, its check of the constexpr globals the kernels read
    (aot.global_checks_seconds); on a GPU, ``direct_second_launches``: the second launches whose
    compiled kernel is known by then (launch.RETRIES), launched without the binder."""
    from megatron_abft.dev import aot
    from megatron_abft.flash import FlashLedger, flash_attention, launch

    seq = 2048 if device.type == "cuda" else 128
    dtype = torch.bfloat16
    q, k, v = (torch.randn(1, 16, seq, 64, dtype=dtype, device=device) for _ in "qkv")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    grad = torch.randn_like(q)
    ledger = FlashLedger.on(device)
    launches: list = []  # on the CPU, recorded and not run (the interpreter's time is no GPU's)
    stubbed = aot.recording(launches) if device.type == "cpu" else contextlib.nullcontext()
    result = {}
    with stubbed:
        for name, sections in (("checked", {}), ("unchecked", {"sections": ()})):

            def call(sections=sections):
                o = flash_attention(q, k, v, ledger=ledger, **sections)
                torch.autograd.grad(o, (q, k, v), grad)

            for _ in range(10):
                call()
            times, count = [], 0
            for _ in range(number):
                launches.clear()  # the records hold the call's tensors: one call's at a time
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                begin = time.perf_counter()
                call()
                times.append(time.perf_counter() - begin)
                count += len(launches)
            per_call = count / number if device.type == "cpu" else None
            result[name] = {"host": statistics.median(times), "launches": per_call}
            if device.type == "cpu":
                bound = [record for record in launches if not record[2].get("RETRY")]
                result[name].update(bound=len(bound), binder=aot.binder_seconds(bound))
                result[name]["globals"] = aot.global_checks_seconds(launches)
            launches.clear()
            result[name]["profile"] = profiled(call, device, number // 4, launches)
            if device.type == "cuda":
                result[name]["kernels"] = device_kernels(call, device)
                # second launches that now go straight to their compiled kernel (launch._twice)
                result[name]["direct_second_launches"] = len(launch.RETRIES)
    return result


def profiled(call, device: torch.device, calls: int, launches: list) -> dict:
    """Where the host's time of ``calls`` calls goes, a call's share (cProfile, which slows
    what it watches: shares, not times): inside Triton's launcher (its JIT functions' ``run``,
    binding, cache and driver launch included), and the functions that spend most of it
    themselves."""
    profile = cProfile.Profile()
    for _ in range(calls):
        launches.clear()
        profile.enable()
        call()
        profile.disable()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (calls, ..., tottime, cumtime)
    stats = {key: row for key, row in stats.items() if "_lsprof.Profiler" not in key[2]}
    total = sum(row[2] for row in stats.values())

    def launcher(key) -> bool:
        return key[2] == "run" and key[0].replace(os.sep, "/").endswith("triton/runtime/jit.py")

    top = sorted(stats.items(), key=lambda item: -item[1][2])[:12]
    return {
        "calls": calls,
        "profiled_us": total / calls * 1e6,
        "triton_launcher_share": sum(stats[k][3] for k in stats if launcher(k)) / total,
        "top": [
            {
                "function": f"{Path(file).name}:{line}({fn})",
                "calls": row[0] / calls,
                "share": row[2] / total,
            }
            for (file, line, fn), row in top
        ],
    }


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number above 0")
    return value


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24, help="of the model for set/finish_step")
    p.add_argument(
        "--calls", type=_positive, default=1.0,
        help="each timing's calls, as a multiple of its default (0.1: a run that checks the tool "
        "works, in a tenth of the time, with noisier times)",
    )  # fmt: skip
    p.add_argument("--out", help="JSON results")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if not cuda:
        from megatron_abft.cpu import enable_cpu_mode

        enable_cpu_mode()
        torch.set_num_threads(1)  # the host's own thread: op overhead, not its parallel work
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    torch.distributed.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)

    def scaled(number: int) -> int:
        return max(1, round(number * args.calls))

    check = clean_check(device, scaled(CHECK_CALLS), scaled(COLD_CALLS))
    calls = sync_free_calls(device)
    step = per_step(args.layers, device, scaled(STEP_CALLS))
    flash = flash_call(device, scaled(FLASH_CALLS))
    result = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "clean_check": check,
        "sync_free_check_calls": calls,
        "per_step": {"layers": args.layers, **step},
        "flash_call": flash,
    }
    us = 1e6
    print(f"on {result['device']}, torch {torch.__version__}")
    print(
        f"a clean check: {check['check'] * us:.1f} us, its op alone {check['ops_alone'] * us:.1f}"
        f" us: {(check['check'] - check['ops_alone']) * us:.1f} us of Python around it"
    )
    print(
        f"with cold caches: the check {check['check_cold'] * us:.1f} us, its op alone"
        f" {check['ops_alone_cold'] * us:.1f} us, the GEMM it checks"
        f" {check['gemm_cold'] * us:.1f} us"
    )
    if "checked_gemm" in check:
        print(
            f"the checked GEMM and its tally: {check['checked_gemm'] * us:.1f} us,"
            f" the GEMM alone {check['gemm'] * us:.1f} us"
        )
    if calls:
        print(
            f"a sync-free check's op on the CUDA kernels ({'on the GPU' if cuda else 'emulated'}):"
            f" {calls['aten_calls']} calls into ATen, {calls['tensors']} tensors made"
        )
    for name, row in (("unfused", step), ("flash, after a step", step["flash"])):
        print(
            f"{args.layers} layers, {name} ({row['modules']} modules): set_step"
            f" {row['set_step'] * 1e3:.2f} ms, finish_step {row['finish_step'] * 1e3:.2f} ms,"
            f" the telemetry's gather {row['gather'] * 1e3:.2f} ms"
        )
    for name, row in flash.items():
        launches = f", {row['launches']:.0f} launches (counted, not run)" if row["launches"] else ""
        print(f"the flash attention's call, {name}: {row['host'] * 1e3:.3f} ms{launches}")
        if "binder" in row:
            print(
                f"  Triton's binder on the {row['bound']} launches that take it (sm_90):"
                f" {row['binder'] * us:.0f} us"
            )
            print(f"  its launcher's check of the kernels' globals: {row['globals'] * us:.1f} us")
        if "direct_second_launches" in row:
            direct = row["direct_second_launches"]
            print(f"  second launches known, launched without the binder: {direct}")
        profile = row["profile"]
        print(
            f"  profiled: {profile['triton_launcher_share']:.0%} inside Triton's launcher; most"
            f" of the rest: {', '.join(t['function'] for t in profile['top'][:4])}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
