"""Measure what protection costs: protected vs unprotected in one run, interleaved.

One model; the ABFT config is switched between modes on every repetition (off, all sections,
with --decompose all sections with the checks skipped and with the CPU's screens unread, then
idle: protection on with nothing due, then each section alone), in a rotating order, after
warm-up. Reported: median times and page faults per step, and the overhead as the median over
repetitions of each one's ratio to the "off" run of the same repetition, for the training step
(forward, backward, optimizer; a protected step with the launch script's set_step before it and
finish_step after its backward, which read the ledgers on the host) and the attention block,
with a 95% bootstrap interval; and the time of one check of each section inside the "all"
steps. CPU timers on CPU, CUDA events on a GPU; on CPU, glibc malloc's thresholds are pinned
first (pin_malloc). The JSON also holds micro-benchmarks of the machine (matmul rate,
elementwise bandwidth, op latency, the kernels' read rate, the softmaxes' costs) that calibrate
megatron_abft.tuning.scaling: taken before, halfway through and after the timed steps, and
their medians.

    python -m tools.bench_overhead --layers 4 --hidden 512 --heads 8 --seq 512 --dtype fp32 \
        --out docs/figures/bench_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import resource
import socket
import statistics
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import torch

from bench.malloc import pin_malloc
from bench.timing import Timer
from megatron_abft.check.checksum import encode
from megatron_abft.check.sides import NO_SCREEN
from megatron_abft.config import DTYPES, FORWARD_SECTIONS, SECTIONS, ABFTConfig
from megatron_abft.ops import compiled, fused_softmax
from megatron_abft.runtime.guard import SectionGuard, checks_apart
from megatron_abft.tuning.scaling import ADAM_BYTES_PER_PARAMETER


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-groups", type=int, default=None)
    p.add_argument("--ffn", type=int, default=None, help="default 4 x hidden")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (spawned)")
    p.add_argument("--dtype", choices=DTYPES, default="fp32")
    p.add_argument(
        "--attention",
        choices=("unfused", "flash"),
        default="unfused",
        help="the protected core attention (get_gpt_layer_abft_spec's attention)",
    )
    p.add_argument(
        "--sections",
        default=None,
        help="checked in mode 'all' (default: every section the attention checks)",
    )
    p.add_argument("--check-interval", type=int, default=1)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=8)
    p.add_argument(
        "--threads", type=int, default=None,
        help="CPU: torch's threads a rank (default: the cores shared by the ranks)",
    )  # fmt: skip
    p.add_argument("--no-per-section", action="store_true", help="time only off and all")
    p.add_argument(
        "--decompose",
        action="store_true",
        help=f"unfused: also time 'all' with its checks skipped and with its CPU screens "
        f"passing unread ({', '.join(DECOMPOSED)}): what the protected layers, the Python around "
        "each check and the screens cost in a step",
    )
    p.add_argument(
        "--no-pin-malloc",
        dest="pin_malloc",
        action="store_false",
        help="CPU: keep glibc malloc's moving thresholds (see pin_malloc)",
    )
    p.add_argument(
        "--no-fused-softmax",
        dest="fused_softmax",
        action="store_false",
        help="keep Megatron's softmax (ABFTConfig.fused_softmax): the checks read S and P apart",
    )
    p.add_argument(
        "--checked-gemm",
        action="store_true",
        help="the QKV and output projections, and the unfused attention's scores and context, "
        "by the checked GEMM (ABFTConfig.checked_gemm), which checks its tiles in its own "
        "epilogue",
    )
    p.add_argument("--out", type=Path, default=None, help="JSON results")
    args = p.parse_args(argv)
    if args.decompose and args.attention == "flash":
        p.error("--decompose stubs the unfused attention's checks; the flash kernels check inside")
    return args


def _small_scores_check(device: torch.device, m: int, k: int, alpha: float, sync_free: bool | None):
    """A guard's clean check of a small attention-scores GEMM (K shared by two heads), as a
    call, after the warm-up checks that allocate the guard's counters."""
    from megatron_abft.check.eec import GemmOperands
    from megatron_abft.runtime.guard import SectionGuard

    guard = SectionGuard("scores", ABFTConfig(on_uncorrectable="log", sync_free=sync_free), 0)
    a = torch.randn(1, 4, 2, m, k, device=device)
    b = torch.randn(1, 4, 1, k, m, device=device)
    operands, c = GemmOperands(a, b, alpha), alpha * (a @ b)
    for _ in range(10):
        guard.check(c, operands)
    return lambda: guard.check(c, operands)


def check_cost(device: torch.device, reps: int = 200) -> tuple[int, float]:
    """The host's calls of one clean check (tensor ops, counted by torch.profiler, and the CPU's
    screen alone, compiled.screen_passes) and the time of one such call, eager dispatch and the
    Python around it included: a guard checking a tiny batched GEMM, whose time is all call
    overhead. With the default ABFTConfig.sync_free (by device)."""
    check = _small_scores_check(device, 16, 8, 1.0, sync_free=None)
    ops = calls(check)
    timer = Timer.on(device)
    begin = timer.start()
    for _ in range(reps):
        check()
    return ops, timer.seconds(begin, timer.start()) / reps / ops


def bias_ops(device: torch.device) -> int:
    """The ops a bias adds to a guard's clean check, counted as check_cost counts them: a qkv
    projection's (32 tokens, hidden 64, 192 outputs) with and without its bias."""
    from megatron_abft.check.eec import GemmOperands
    from megatron_abft.runtime.guard import SectionGuard

    x, w = torch.randn(32, 64, device=device), torch.randn(192, 64, device=device)
    counted = []
    for bias in (None, torch.randn(192, device=device)):
        guard, operands = SectionGuard("qkv", ABFTConfig(), 0), GemmOperands(x, w.t(), 1.0, bias)
        y = x @ w.t() + (0 if bias is None else bias)
        for _ in range(3):  # the checker is chosen after the first
            guard.check(y, operands)
        counted.append(calls(partial(guard.check, y, operands)))
    return counted[1] - counted[0]


def check_kernels(device: torch.device) -> list[str] | None:
    """The GPU kernels (and memsets) one clean sync-free check launches, by name, as
    torch.profiler sees them on a small attention-scores check (alpha 1/8). None off a GPU."""
    if device.type != "cuda":
        return None
    check = _small_scores_check(device, 64, 32, 0.125, sync_free=True)
    torch.cuda.synchronize(device)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        check()
        torch.cuda.synchronize(device)
    return [e.name for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def check_launches(device: torch.device) -> int | None:
    """How many launches one clean sync-free check makes (check_kernels), the figure the
    overhead model takes for a GPU (devices.CHECK_KERNELS). None off a GPU."""
    kernels = check_kernels(device)
    return None if kernels is None else len(kernels)


def check_read_rate(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, block: int):
    """Bytes per second at which the kernels' block sums (both sides) read a batch of matrices
    of ``shape`` that is in no cache, as a check reads its GEMM's output inside a step: the
    overhead model's ``check_bandwidth``. None where the kernels do not serve ``device``."""
    c = torch.randn(shape, device=device).to(dtype)
    if compiled.block_sums(c, block, block) is None:
        return None
    flush = torch.ones(64 * 2**20, device=device)  # 256 MiB, read between runs: more than caches
    timer = Timer.on(device)
    times = []
    for _ in range(15):
        flush.sum()
        begin = timer.start()
        compiled.block_sums(c, block, block)
        times.append(timer.seconds(begin, timer.start()))
    return c.numel() * c.element_size() / statistics.median(times)


def median_seconds(fn, timer: Timer, reps: int = 15) -> float:
    """The median time of ``reps`` calls of ``fn``, after one untimed (warm) call."""
    fn()
    times = []
    for _ in range(reps):
        begin = timer.start()
        fn()
        times.append(timer.seconds(begin, timer.start()))
    return statistics.median(times)


def check_dot_cost(args, device: torch.device, matmul: float) -> float | None:
    """Seconds of one dot product of the checks' products kernel beyond its multiply-adds (at
    ``matmul``): the kernel projecting the run's queries, as Megatron lays them out (a head's
    rows strided by the others'), on the block sums of keys as long as the sequence, warm, as
    the scores' check does after its GEMM read them. The overhead model's ``check_dot``. None
    off a CPU (a GPU's products kernels are priced by their bytes) or without the kernels."""
    if device.type != "cpu" or not compiled.available():
        return None
    heads, hn = args.heads // args.tp, args.hidden // args.heads
    blocks = -(-args.seq // args.block)
    query = torch.randn(args.seq, args.micro_batch, heads, hn, device=device)
    rows = query.to(DTYPES[args.dtype]).permute(1, 2, 0, 3)  # [b, np, s, hn], strided as q5
    u = torch.randn(args.micro_batch, heads, 2 * blocks, hn, device=device)
    z = torch.randn(args.micro_batch, heads, blocks, hn, device=device).abs()
    products = torch.ops.megatron_abft.row_products
    dots = args.micro_batch * heads * args.seq * 3 * blocks
    seconds = median_seconds(lambda: products(rows, u, z, 1.0), Timer(cuda=False))
    seconds -= 2 * dots * hn / matmul
    return max(seconds, 0.0) / dots


def calls(run: Callable[[], object]) -> int:
    """The host's calls into compiled code of one ``run``: its top-level operators as
    torch.profiler counts them (aten ops and the extension's; the ops they call are not
    counted), and its calls of compiled.screen_passes, which is no op."""
    screens = 0
    screen_passes = compiled.screen_passes

    def counted(*args):
        nonlocal screens
        screens += 1
        return screen_passes(*args)

    cpu = [torch.profiler.ProfilerActivity.CPU]
    compiled.screen_passes = counted
    try:
        with torch.profiler.profile(activities=cpu, acc_events=True) as profile:
            run()
    finally:
        compiled.screen_passes = screen_passes
    return screens + sum(1 for e in profile.events() if e.cpu_parent is None and "::" in e.name)


def softmax_costs(module, args, device: torch.device) -> dict[str, float]:
    """Seconds per element of S of the scale-mask-softmax's parts (devices.SOFTMAX_PARTS) at the
    model's scores, each op alone: Megatron's ``module`` (the model's own) forward and
    backward, and where the fused softmax serves the device (fused_softmax.fusable) what its screen
    of S and its pass over P add to its forward. Medians of 31. The fused softmax's own difference
    to Megatron's softmax is measured inside the steps (fused_softmax_swap)."""
    from megatron_abft.check.eec import Check, kernel_sides
    from megatron_abft.check.tolerance import gemm_rounding

    heads, groups = args.heads // args.tp, max((args.kv_groups or args.heads) // args.tp, 1)
    b, seq, hn = args.micro_batch, args.seq, args.hidden // args.heads
    g = torch.Generator().manual_seed(2)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=DTYPES[args.dtype])

    q, k = randn(b, groups, heads // groups, seq, hn), randn(b, groups, 1, hn, seq)  # k: K^T
    v = randn(b, groups, 1, seq, hn)
    alpha = hn**-0.5
    leaf = (alpha * (q @ k)).requires_grad_()
    grad = torch.randn_like(leaf)
    timer = Timer.on(device)

    def timed(softmax) -> tuple[float, float]:
        """Forward and backward of ``softmax`` on a fresh copy of S, as the scores GEMM hands
        it over (Megatron's mask function writes into its input)."""
        forward, backward = [], []
        for _ in range(32):
            scores = leaf.clone()
            begin = timer.start()
            out = softmax(scores)
            middle = timer.start()
            torch.autograd.grad(out, leaf, grad.view_as(out))
            forward.append(timer.seconds(begin, middle))
            backward.append(timer.seconds(middle, timer.start()))
        return statistics.median(forward[1:]), statistics.median(backward[1:])

    def megatron(scores):
        return module(scores.view(b, heads, seq, seq), None, None)

    costs = dict(zip(("forward", "backward"), timed(megatron), strict=True))
    if fused_softmax.fusable(module, leaf.view(b, heads, seq, seq), None, None):
        with torch.no_grad():
            refs = encode(q, k, alpha=alpha, block=args.block)
        check = Check(gemm_rounding(leaf.dtype, device), 1.0, 1e10, 0, None)
        sides = kernel_sides(leaf.detach(), {"col": refs[0], "row": refs[1]}, check)
        vectors = compiled.pair_vectors(leaf.detach(), v, args.block)

        def softmax_with(checks=NO_SCREEN, pass_vectors=None):
            return lambda s: fused_softmax.softmax(
                module, s, None, checks, args.block, pass_vectors
            )[0]

        alone = timed(softmax_with())[0]
        costs["screen"] = max(timed(softmax_with(sides))[0] - alone, 0.0)
        costs["pass"] = max(timed(softmax_with(pass_vectors=vectors))[0] - alone, 0.0)
    return {part: seconds / leaf.numel() for part, seconds in costs.items()}


class FusedSoftmaxAlone(fused_softmax.SoftmaxReader):
    """The fused softmax, with no checks, where the attention would take Megatron's softmax."""

    def plain(self, scores):
        return self.read(scores, NO_SCREEN)[0], None


def fused_softmax_swap(model, forward_backward, pairs: int = 100) -> tuple[float, float]:
    """Forward and backward time one layer saves (negative) or loses where its softmax is
    the fused softmax with no checks instead of Megatron's: medians over ``pairs`` pairs of training
    steps with protection idle, each kind first in turns. Timed alone, the fused softmax's advantage
    comes out larger than inside a step. ``forward_backward`` runs a step's forward and backward
    and returns their times. A layer the fused softmax cannot serve keeps Megatron's."""
    cores = [layer.self_attention.core_attention for layer in model.decoder.layers]

    def unchecked_reader(core):
        def reader(scores, v5, mask):
            made = type(core)._softmax_reader(core, scores, v5, mask)
            return FusedSoftmaxAlone(**vars(made)) if made.fused else made

        return reader

    differences = []
    for core in cores:  # idle, a layer would run Megatron's forward: both kinds take the same
        core.forward = core.protected_forward
    for rep in range(pairs + 1):
        times = {}
        for fused in (rep % 2 == 0, rep % 2 == 1):
            for core in cores:  # an instance attribute hides the class's _softmax_reader
                if fused:
                    core._softmax_reader = unchecked_reader(core)
                else:
                    core.__dict__.pop("_softmax_reader", None)
            times[fused] = forward_backward()
        differences.append([x - y for x, y in zip(times[True], times[False], strict=True)])
    for core in cores:
        core.__dict__.pop("_softmax_reader", None)
        core.__dict__.pop("forward", None)
    return tuple(statistics.median(d[i] for d in differences[1:]) / len(cores) for i in (0, 1))


def micro_benchmarks(args, device: torch.device, softmax) -> dict:
    """Matmul FLOP/s at the model's GEMM size, elementwise bandwidth, one op's latency, the ops
    of one check with their latency, the rate at which the kernels read the scores, and the
    costs of the model's ``softmax`` (a Megatron FusedScaleMaskSoftmax) and of the fused softmax's
    checks."""
    dtype, hidden = DTYPES[args.dtype], args.hidden
    tokens = args.seq * args.micro_batch
    timer = Timer.on(device)
    a = torch.randn(tokens, hidden, device=device).to(dtype)
    b = torch.randn(hidden, 4 * hidden, device=device).to(dtype)
    matmul = 2 * tokens * hidden * 4 * hidden / median_seconds(lambda: a @ b, timer)
    x = torch.randn(32 * 2**20 // 4, device=device)
    y = torch.empty_like(x)  # written in place: a fresh output would time the OS's page faults
    bandwidth = 2 * x.numel() * 4 / median_seconds(lambda: torch.abs(x, out=y), timer)
    one = torch.zeros(1, device=device)
    launch = median_seconds(lambda: [one.add(1) for _ in range(200)], timer) / 200
    check_ops, check_op = check_cost(device)
    return {
        "matmul": matmul,
        "bandwidth": bandwidth,
        "launch": launch,
        "check_ops": check_ops,
        "bias_ops": bias_ops(device),
        "check_op": check_op,
        "check_launches": check_launches(device),
        "check_dot": check_dot_cost(args, device, matmul),
        "check_bandwidth": check_read_rate(
            (args.micro_batch * args.heads // args.tp, args.seq, args.seq),
            dtype,
            device,
            args.block,
        ),
        "softmax": softmax_costs(softmax, args, device),
    }


def build_model(args, config: ABFTConfig):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_abft.spec import get_gpt_layer_abft_spec

    dtype = DTYPES[args.dtype]
    transformer = TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        num_query_groups=args.kv_groups,
        ffn_hidden_size=args.ffn or 4 * args.hidden,
        tensor_model_parallel_size=args.tp,
        use_cpu_initialization=True,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    model = GPTModel(
        config=transformer,
        transformer_layer_spec=get_gpt_layer_abft_spec(config, attention=args.attention),
        vocab_size=args.vocab,
        max_sequence_length=args.seq,
        position_embedding_type="rope",
    )
    # every parameter in the training dtype, as Megatron's Float16Module casts them (the torch
    # LayerNorm that stands in for Apex's keeps fp32 weights, which CUDA's layer_norm refuses
    # beside bf16 inputs)
    model = model.to(dtype)
    return model.cuda() if torch.cuda.is_available() else model


DECOMPOSED = ("skipped", "unread")
"""--decompose's modes (the unfused attention): "all" with every due check returning its output
unverified (SectionGuard.verify: the protected layers' own cost), and with the CPU's screens
answering clean without reading (compiled.screen_passes: the layers and the Python around each
check; on a GPU, whose checks take no host screen, as "all")."""


def timed_modes(args) -> list[tuple[str, tuple[str, ...] | None]]:
    """(name, the sections checked; None: protection disabled). "idle" enables protection with
    nothing due: what the protected layers cost when they check nothing."""
    checked = SECTIONS if args.attention == "flash" else FORWARD_SECTIONS
    chosen = checked if args.sections is None else args.sections.split(",")
    sections = tuple(s for s in checked if s in chosen)
    modes = [("off", None), ("all", sections)]
    if args.decompose:
        modes += [(name, sections) for name in DECOMPOSED]
    if not args.no_per_section:
        modes += [("idle", ())] + [(s, (s,)) for s in sections]
    return modes


@contextlib.contextmanager
def decomposed(mode: str) -> Iterator[None]:
    """In a DECOMPOSED mode, its stub in place for the block; elsewhere nothing."""
    if mode == "skipped":
        target, name, stub = SectionGuard, "verify", lambda self, output, *_, **__: output
    elif mode == "unread":
        target, name, stub = compiled, "screen_passes", lambda *_: True
    else:
        yield
        return
    kept = getattr(target, name)
    setattr(target, name, stub)
    try:
        yield
    finally:
        setattr(target, name, kept)


def run(rank: int, args) -> dict | None:
    """One rank of the benchmark; rank 0 returns the results."""
    from megatron.core import parallel_state, tensor_parallel

    from megatron_abft import finish_step, set_step, stats

    config = ABFTConfig(
        check_interval=args.check_interval,
        block_size=args.block,
        on_uncorrectable="log",
        fused_softmax=args.fused_softmax,
        checked_gemm=args.checked_gemm,
    )
    model = build_model(args, config)
    device = next(model.parameters()).device
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-5)
    timer = Timer.on(device)
    attention_time = []

    def before(module, _):
        module._abft_bench_start = timer.start()

    def after(module, *_):
        attention_time.append((module._abft_bench_start, timer.start()))

    for layer in model.decoder.layers:
        layer.self_attention.register_forward_pre_hook(before)
        layer.self_attention.register_forward_hook(after)
    # (section) -> (step, begin, end) of each timed span
    check_time = {s: [] for s in SECTIONS}
    timing = {"on": False, "step": 0}  # on: the measured "all" steps
    time_checks(model, timer, check_time, timing)

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=g).to(device)
    positions = torch.arange(args.seq, device=device).unsqueeze(0).expand(args.micro_batch, -1)
    modes = timed_modes(args)
    # the device's rates, before, halfway through and after the timed steps (the machine drifts)
    softmax = model.decoder.layers[0].self_attention.core_attention.scale_mask_softmax
    rounds = [micro_benchmarks(args, device, softmax)]

    def forward_backward() -> tuple[float, float]:
        begin = timer.start()
        loss = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).float().mean()
        middle = timer.start()
        loss.backward()
        end = timer.start()
        model.zero_grad(set_to_none=True)
        return timer.seconds(begin, middle), timer.seconds(middle, end)

    samples = {name: {"step": [], "attention": [], "optimizer": []} for name, _ in modes}
    faults = {name: [] for name, _ in modes}  # the process's minor page faults in each step
    step = 0
    for rep in range(args.warmup + args.reps):
        if rep == args.warmup + args.reps // 2:
            rounds.append(micro_benchmarks(args, device, softmax))
        order = (
            modes[rep % len(modes) :] + modes[: rep % len(modes)]
        )  # rotate: no mode always first
        for name, sections in order:
            protected = sections is not None
            config.enabled = protected
            config.sections = config.sections if sections is None else sections
            if not protected:  # a stock loop makes no step calls; the guards still need the step
                set_step(model, step)
            attention_time.clear()
            timing.update(on=name == "all" and rep >= args.warmup, step=step + 1)
            faulted = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            with decomposed(name):
                begin = timer.start()
                if protected:  # the launch script's step calls, each a read of the ledgers
                    set_step(model, step)
                optimizer.zero_grad(set_to_none=True)
                loss = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).float().mean()
                loss.backward()
                if protected:
                    finish_step(model)
                before_optimizer = timer.start()
                optimizer.step()
                end = timer.start()
            timing["on"] = False
            step += 1
            faulted = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faulted
            if rep >= args.warmup:
                faults[name].append(faulted)
                samples[name]["step"].append(timer.seconds(begin, end))
                samples[name]["optimizer"].append(timer.seconds(before_optimizer, end))
                samples[name]["attention"].append(
                    sum(timer.seconds(b, e) for b, e in attention_time)
                )
    # the fused softmax's difference to Megatron's softmax, a layer, inside steps: after the timed
    # ones, on a warm model and heap (measured before them, it came out larger)
    swap = None
    unfused = args.attention == "unfused"
    # the fused softmax reads the scores
    if unfused and args.fused_softmax and "screen" in rounds[0]["softmax"]:
        config.enabled, config.sections = True, ()
        # fewer pairs for larger micro-batches: each step is longer and less noisy (at 8, the
        # default 100 pairs took an H200 over two minutes)
        swap = fused_softmax_swap(model, forward_backward, max(12, 100 // args.micro_batch))
    rounds.append(micro_benchmarks(args, device, softmax))
    found = stats(model)  # every step's clean data: what the checks flagged is a false alarm
    if parallel_state.get_tensor_model_parallel_rank() != 0:
        return None
    result = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "impl": implementation(args),
        "backend": compiled.backend(),
        "machine": median_rates(rounds),
        "machine_rounds": rounds,
        "median": {n: {k: statistics.median(v) for k, v in s.items()} for n, s in samples.items()},
        "page_faults": {n: statistics.median(f) for n, f in faults.items()},  # per step
        "false_alarms": sum(sum(s["detected"].values()) for s in found.values()),
        # one check of one layer, inside the measured "all" steps
        "check_seconds": {
            section: per_check(spans, timer, len(model.decoder.layers))
            for section, spans in check_time.items()
            if spans
        },
    }
    if swap is not None:  # the fused softmax's difference in a step, per element of S
        elements = args.micro_batch * args.heads // args.tp * args.seq**2
        result["machine"]["softmax"].update(
            fused_softmax_forward=swap[0] / elements, fused_softmax_backward=swap[1] / elements
        )
    parameters = sum(p.numel() for p in model.parameters())  # this rank's
    result["machine"]["optimizer_bandwidth"] = (
        parameters * ADAM_BYTES_PER_PARAMETER / result["median"]["off"]["optimizer"]
    )
    # each repetition's ratio to the "off" step of the same repetition, then the median: slow
    # drifts of the machine cancel within a repetition
    ratios = {
        name: {
            k: [t / o for t, o in zip(v, samples["off"][k], strict=True)] for k, v in mode.items()
        }
        for name, mode in samples.items()
    }
    result["overhead"] = {
        name: {k: statistics.median(r) - 1 for k, r in mode.items()}
        for name, mode in ratios.items()
    }
    result["interval"] = {
        name: {k: median_interval(r) for k, r in mode.items()} for name, mode in ratios.items()
    }
    del tensor_parallel  # imported for its side effect of being ready in workers
    return result


def implementation(args) -> str:
    """How the checks ran, as megatron_abft.tuning.scaling names it: ``flash``; ``fused`` where
    the fused softmax computes the softmax and both attention checks ride on it (on CUDA, where a
    sync-free check of the scores corrects in the softmax's op); ``apart`` where the fused softmax
    computes the softmax and the checks run apart (a CPU's, guard.checks_apart); else
    ``kernels`` or ``torch``."""
    if args.attention == "flash":
        return "flash"
    if not compiled.available():
        return "torch"
    if not args.fused_softmax:
        return "kernels"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return "apart" if checks_apart(ABFTConfig(), device) else "fused"


def time_checks(model, timer: Timer, spans: dict[str, list], timing: dict) -> None:
    """Record when each piece of a due check begins and ends while ``timing["on"]``, as
    ``(step, begin, end)`` under its section (events on a GPU, read after the run: no extra
    synchronisation): every guard's ``check``, and the pieces of the fused path that run
    outside it, the scores' references (``screen_sides``) and the context's (``pair_vectors``
    and ``encode_from_pass`` from P's pass). The fused softmax's own screen and pass are timed apart
    (softmax_costs)."""
    from megatron_abft.runtime.guard import iter_guards

    def timed(fn, section: str, guard=None):
        def run(*args, **kwargs):
            if not (timing["on"] and (guard is None or guard.due)):
                return fn(*args, **kwargs)
            begin = timer.start()
            output = fn(*args, **kwargs)
            spans[section].append((timing["step"], begin, timer.start()))
            return output

        return run

    for guard in iter_guards(model):
        guard.check = timed(guard.check, guard.section, guard)
        guard.screen_sides = timed(guard.screen_sides, guard.section, guard)
    fused_softmax.encode_from_pass = timed(fused_softmax.encode_from_pass, "context")
    compiled.pair_vectors = timed(compiled.pair_vectors, "context")


def per_check(spans: list, timer: Timer, layers: int) -> float:
    """Seconds of one layer's check: each timed step's spans of the section summed and shared
    over the ``layers``; the median over the steps."""
    steps: dict[int, float] = {}
    for step, begin, end in spans:
        steps[step] = steps.get(step, 0.0) + timer.seconds(begin, end)
    return statistics.median(total / layers for total in steps.values())


def median_rates(rounds: list[dict]) -> dict:
    """Each micro-benchmark's median over the ``rounds`` taken through the run (a dict of them,
    as the softmax's parts, part by part); None where a round did not measure it."""
    merged = {}
    for key, first in rounds[0].items():
        values = [r[key] for r in rounds]
        if isinstance(first, dict):
            merged[key] = median_rates(values)
        else:
            merged[key] = None if None in values else statistics.median(values)
    return merged


def median_interval(values: list[float], resamples: int = 2000, seed: int = 0) -> float:
    """Half the width of a 95% bootstrap interval of the median of ``values``: how far the
    measured median could be from the machine's true one, from the spread of the repetitions."""
    draw = random.Random(seed)
    medians = sorted(
        statistics.median(draw.choices(values, k=len(values))) for _ in range(resamples)
    )
    return (medians[int(0.975 * resamples) - 1] - medians[int(0.025 * resamples)]) / 2


def _worker(rank: int, world: int, port: int, args, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    malloc = "default"
    if not torch.cuda.is_available():
        from megatron_abft.cpu import enable_cpu_mode

        if args.pin_malloc:
            malloc = pin_malloc()
        enable_cpu_mode()
        torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // world))
    else:
        torch.cuda.set_device(rank)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    torch.distributed.init_process_group(backend, rank=rank, world_size=world)
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    result = run(rank, args)
    if result is not None:
        result["malloc"] = malloc
        Path(out).write_text(json.dumps(result))
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def benchmark(args) -> dict:
    """Run the benchmark on ``args.tp`` ranks and return rank 0's results."""
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        if args.tp == 1:
            _worker(0, 1, port, args, out)
        else:
            mp.spawn(_worker, args=(args.tp, port, args, out), nprocs=args.tp)
        return json.loads(Path(out).read_text())


def print_table(result: dict) -> None:
    a = result["args"]
    print(
        f"{a['layers']} layers, hidden {a['hidden']}, {a['heads']} heads, seq {a['seq']}, "
        f"micro-batch {a['micro_batch']}, TP {a['tp']}, {a['dtype']}, block {a['block']}, "
        f"interval {a['check_interval']} on {result['device']} ({result['threads']} threads)"
    )
    print(
        f"{'mode':<8} {'step ms':>9} {'step +%':>8} {'attn ms':>9} {'attn +%':>8} "
        f"{'page faults':>11}"
    )
    for name, med in result["median"].items():
        over = result["overhead"][name]
        print(
            f"{name:<8} {med['step'] * 1e3:>9.1f} {over['step'] * 100:>8.2f} "
            f"{med['attention'] * 1e3:>9.1f} {over['attention'] * 100:>8.2f} "
            f"{result['page_faults'][name]:>11.0f}"
        )
    print(
        f"matrices the checks flagged on this clean data (false alarms): {result['false_alarms']}"
    )
    m = result["machine"]
    launches = m.get("check_launches")
    print(
        f"a small clean check: {m['check_ops']} ops at {m['check_op'] * 1e6:.1f} us each"
        + ("" if launches is None else f"; {launches} GPU launches with sync_free")
    )
    read, dot = m.get("check_bandwidth"), m.get("check_dot")
    print(
        f"bandwidth {m['bandwidth'] / 1e9:.1f} GB/s"
        + ("" if read is None else f"; the kernels read the scores at {read / 1e9:.1f} GB/s")
        + ("" if dot is None else f"; a dot product of theirs {dot * 1e9:.2f} ns")
        + (f"; malloc: {result['malloc']}" if "malloc" in result else "")
    )
    a = result["args"]
    elements = a["micro_batch"] * a["heads"] // a["tp"] * a["seq"] ** 2
    ms = {part: cost * elements * 1e3 for part, cost in (m.get("softmax") or {}).items()}
    if "fused_softmax_forward" in ms:
        print(
            f"a layer's softmax: Megatron's {ms['forward']:.2f} ms forward, {ms['backward']:.2f} "
            f"ms backward; the fused softmax in a step {ms['fused_softmax_forward']:+.2f} and "
            f"{ms['fused_softmax_backward']:+.2f} ms, its screen +{ms['screen']:.2f} ms, its pass "
            f"+{ms['pass']:.2f} ms"
        )


def main() -> None:
    args = parse_args()
    result = benchmark(args)
    print_table(result)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        print(f"results: {args.out}")
