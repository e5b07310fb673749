"""The overhead model (megatron_abft.tuning.scaling): the unfused checks' work and the
predictions, held to the code's op counts and to the benchmark's runs (tools/bench_overhead.py,
tools/overhead_report.py). The flash path's work: test_flash_work.py; the device profiles:
test_devices.py."""

import json
import math
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from mcore import Shape, spawn

from megatron_abft.config import FORWARD_SECTIONS, SECTIONS
from megatron_abft.tuning.devices import (
    BIAS_KERNELS,
    BIAS_OPS,
    CHECK_KERNELS,
    CHECK_OPS,
    DEVICES,
    SOFTMAX_PARTS,
    DeviceProfile,
)
from megatron_abft.tuning.scaling import (
    MMA_PRODUCTS_MIN_ELEMENTS,
    MMA_PRODUCTS_OPS,
    PROJECTIONS,
    _share_of_steps,
    forward_backward_time,
    predict,
    projection_costs,
    protection_forward,
    softmax_seconds,
    step_time,
)
from megatron_abft.tuning.shapes import CATALOGUE, ModelShape, Work

SHAPES = {shape.name: shape for shape in CATALOGUE}
RUN4 = Path(__file__).with_name("bench_cpu_run4.json")
"""A CPU run of tools/bench_overhead (200 repetitions, docs/runs.md) the report's tests read."""


@pytest.mark.parametrize(
    "name, published",
    [
        ("GPT-3 125M", 125e6),
        ("GPT-3 1.3B", 1.3e9),
        ("GPT-3 175B", 175e9),
        ("Llama-2 7B", 6.7e9),
        ("Llama-2 70B", 69e9),
        ("Llama-3 8B", 8.0e9),
    ],
)
def test_the_catalogue_has_the_published_parameter_counts(name, published):
    assert SHAPES[name].parameters() == pytest.approx(published, rel=0.06)


def test_protection_costs_forward_work_that_scales_with_what_each_section_reads():
    base = ModelShape("m", 4, 1024, 16, 4096, 32000, seq=1024, dtype="bf16")
    long = replace(base, seq=4096)
    small, large = protection_forward(base), protection_forward(long)
    # scores reads S (seq^2 per head), and encodes Q and K (linear): almost 16x at 4x the seq
    assert 14 < large["scores"].bytes / small["scores"].bytes < 16
    # the linear layers read activations (linear in the sequence) and weights (constant)
    middle = protection_forward(replace(base, seq=2048))
    for section in ("qkv", "proj"):
        grow = [w[section].bytes - small[section].bytes for w in (middle, large)]
        assert grow[1] == pytest.approx(3 * grow[0]) and small[section].bytes > grow[0]
    fused = protection_forward(base, "fused")
    assert all(fused[s].bytes < small[s].bytes / 4 for s in FORWARD_SECTIONS)
    # the fused target reads neither S (verified in the softmax) nor P (summed there)
    kernels = protection_forward(base, "kernels")
    s_or_p = base.micro_batch * base.heads * base.seq**2 * 2  # bf16, TP 1
    assert kernels["scores"].bytes - fused["scores"].bytes == s_or_p
    assert kernels["context"].bytes - fused["context"].bytes == s_or_p
    assert all(kernels[s].bytes == fused[s].bytes for s in ("qkv", "proj"))
    with pytest.raises(ValueError, match="impl 'triton'"):
        protection_forward(base, "triton")


def test_predictions_add_up_and_intervals_divide_the_cost():
    shape = replace(SHAPES["GPT-3 350M"], seq=2048)
    device = DEVICES["H100"]
    every = predict(shape, device, "fused")
    assert every.step == pytest.approx(sum(every.sections.values()))
    halved = predict(shape, device, "fused", intervals=dict.fromkeys(FORWARD_SECTIONS, 2))
    assert halved.step == pytest.approx(every.step / 2)
    only = predict(shape, device, "fused", sections=("scores",))
    assert only.step == pytest.approx(every.sections["scores"])
    assert 0 < every.step < every.attention and every.step_seconds > 0


def test_a_faster_memory_makes_the_memory_bound_checks_cheaper():
    shape = replace(SHAPES["Llama-3 8B"], seq=8192)
    slow = DeviceProfile("slow", {"bf16": 1e15}, 1e12, 0.0, vector=1e15)
    fast = DeviceProfile("fast", {"bf16": 1e15}, 4e12, 0.0, vector=1e15)
    assert predict(shape, fast, "fused").step < predict(shape, slow, "fused").step


def test_the_checksum_products_run_on_the_cuda_cores():
    """The products of a check (its operands against the other side's checksums) are fp32
    multiply-adds on the CUDA cores, Work.vector, 3 vectors a block of each side: no tensor-core
    FLOPs, so the check's time does not follow the matmul rate but the vector rate."""
    shape = replace(SHAPES["GPT-3 350M"], seq=2048, micro_batch=8)
    tokens, h, width = shape.seq * shape.micro_batch, shape.hidden, 3 * shape.hidden
    for impl in ("kernels", "torch"):
        qkv = protection_forward(shape, impl)["qkv"]
        blocks = (tokens // shape.block, width // shape.block)
        assert qkv.flops == 0
        assert qkv.vector == 3 * (blocks[0] * h * width + blocks[1] * h * tokens)
    h200 = DEVICES["H200"]
    qkv = protection_forward(shape, "kernels")["qkv"]
    faster_matmul = replace(h200, matmul={"bf16": 10 * h200.matmul["bf16"]})
    slower_cores = replace(h200, vector=h200.vector / 2)
    assert faster_matmul.check_time(qkv, "bf16") == h200.check_time(qkv, "bf16")
    assert slower_cores.check_time(qkv, "bf16") - h200.check_time(qkv, "bf16") == pytest.approx(
        qkv.vector / h200.vector
    )


def test_a_projections_check_has_a_floor_of_one_read_of_its_output():
    """projection_costs: each projection's GEMM at the matmul rate, its clean check as the
    kernels run it, and the floor, the output read once at the bandwidth: about (matmul rate /
    bandwidth) / k of the GEMM, however fast the kernels are."""
    h200 = DEVICES["H200"]
    for name, micro_batch in (("GPT-3 350M", 8), ("GPT-3 175B", 1)):
        shape = replace(SHAPES[name], seq=2048, micro_batch=micro_batch)
        costs = projection_costs(shape, h200)
        assert set(costs) == set(PROJECTIONS)
        tokens, h, tp = shape.seq * shape.micro_batch, shape.hidden, shape.tp
        for section, (k, n) in {"qkv": (h, 3 * h // tp), "proj": (h // tp, h)}.items():
            cost = costs[section]
            assert cost.gemm == pytest.approx(2 * tokens * k * n / h200.matmul["bf16"])
            assert cost.floor == pytest.approx(2 * tokens * n / h200.bandwidth)
            rate_over_bandwidth = h200.matmul["bf16"] / h200.bandwidth
            assert cost.floor / cost.gemm == pytest.approx(rate_over_bandwidth / k)
            assert cost.floor < cost.check
    # the output projection's is never near 2%: at TP 8 its k is an eighth of the hidden size
    big = projection_costs(replace(SHAPES["GPT-3 175B"], seq=2048), h200)
    assert big["qkv"].floor / big["qkv"].gemm < 0.02 < 0.1 < big["proj"].floor / big["proj"].gemm


def test_checks_read_at_their_own_bandwidth():
    """A profile's check_bandwidth prices the checks' bytes (and only theirs); without it they
    read at the streaming bandwidth."""
    work = Work(bytes=1e9, ops=2)
    plain = DeviceProfile("d", {"fp32": 1e12}, 1e10, 1e-3, vector=5e11)
    slow_checks = replace(plain, check_bandwidth=2.5e9, check_op=2e-3)
    assert plain.check_time(work, "fp32") == pytest.approx(0.1 + 0.002)
    assert slow_checks.check_time(work, "fp32") == pytest.approx(0.4 + 0.004)
    assert slow_checks.time(work, "fp32") == plain.time(work, "fp32")
    shape = replace(SHAPES["GPT-3 125M"], seq=1024, dtype="fp32")
    assert step_time(shape, slow_checks) == step_time(shape, plain)
    assert predict(shape, slow_checks, "kernels").step > predict(shape, plain, "kernels").step


def test_the_kernels_dot_products_are_counted_and_priced_apart():
    """Work.dots: a products kernel's rows against its checksum vectors, both sides of each
    checked GEMM (3 vectors a block); the torch path's products are BLAS's and count none.
    DeviceProfile.check_dot prices them in the checks' time only."""
    shape = ModelShape("m", 2, 512, 8, 2048, 1000, seq=1024, dtype="fp32", block=256)
    kernels, torch_path = protection_forward(shape, "kernels"), protection_forward(shape, "torch")
    blocks = shape.seq // shape.block
    per_side = shape.micro_batch * shape.heads * 3 * blocks * shape.seq  # [e w] and |.| rows
    assert kernels["scores"].dots == 2 * per_side
    tokens, width = shape.seq * shape.micro_batch, 3 * shape.hidden
    qkv_dots = 3 * (tokens // shape.block * width + width // shape.block * tokens)
    assert kernels["qkv"].dots == qkv_dots
    assert all(torch_path[s].dots == 0 for s in FORWARD_SECTIONS)
    assert (Work(dots=3) + Work(dots=4) * 0.5).dots == 5
    plain = DeviceProfile("d", {"fp32": 1e12}, 1e10, 1e-3, vector=5e11)
    dotted = replace(plain, check_dot=2e-9)
    work = Work(bytes=1e9, ops=2, dots=1e6)
    assert dotted.check_time(work, "fp32") - plain.check_time(work, "fp32") == pytest.approx(2e-3)
    assert dotted.time(work, "fp32") == plain.time(work, "fp32")
    assert step_time(shape, dotted) == step_time(shape, plain)
    assert predict(shape, dotted, "kernels").step > predict(shape, plain, "kernels").step
    assert predict(shape, dotted, "torch").step == predict(shape, plain, "torch").step
    assert all(device.check_dot == 0 for device in DEVICES.values())
    with pytest.raises(ValueError, match="check_dot"):
        replace(plain, check_dot=-1e-9)


def test_the_benchmark_measures_what_the_model_calibrates_on():
    """bench_overhead's rates: the kernels' read rate of a matrix in no cache (None without the
    kernels)."""
    from bench.overhead import check_read_rate
    from bench.overhead_report import calibrated
    from megatron_abft.ops import compiled

    cpu = torch.device("cpu")
    if compiled.available():  # a rate in bytes a second; its size is the benchmark's to report,
        # and a busy machine (the suite's other worker) can slow a 32 KiB read a thousandfold
        rate = check_read_rate((2, 64, 64), torch.float32, cpu, 32)
        assert 0 < rate < 1e13
    with compiled.disabled():
        assert check_read_rate((2, 64, 64), torch.float32, cpu, 32) is None
    run = json.loads(RUN4.read_text())
    assert calibrated(run).check_bandwidth is None  # a run from before the rate was measured
    assert calibrated(run).check_dot == 0
    run["machine"].update(check_bandwidth=3e9, check_dot=4e-9)
    assert calibrated(run).check_bandwidth == 3e9 and calibrated(run).check_dot == 4e-9


def test_the_benchmark_prices_a_dot_product_of_the_kernels_on_a_cpu():
    """check_dot_cost: the products kernel on queries as Megatron lays them out, less its
    multiply-adds; None without the kernels."""
    from bench.overhead import check_dot_cost, parse_args
    from megatron_abft.ops import compiled

    args = parse_args(["--seq", "256", "--hidden", "256", "--heads", "4", "--block", "64"])
    cpu = torch.device("cpu")
    if compiled.available():
        # a dot product's, not a call's (12288 of them, about 0.1 ms): about 8 ns here, and
        # under 1.2 us on this machine loaded by the suite's other worker
        cost = check_dot_cost(args, cpu, matmul=1e11)
        assert 0 <= cost < 1e-5
        assert check_dot_cost(args, cpu, matmul=1e6) == 0  # all its time is multiply-adds
        args.dtype = "bf16"  # the queries in the run's dtype, the sums in fp32
        assert 0 <= check_dot_cost(args, cpu, matmul=1e11) < 1e-5
    with compiled.disabled():
        assert check_dot_cost(args, cpu, matmul=1e11) is None


def test_the_benchmark_reuses_one_heap_for_blocks_of_any_size():
    """pin_malloc keeps large blocks off mmap: steps that take and free 64 MiB blocks (the
    scores from sequence 1024 on are 32 MiB and more, above what glibc's mmap threshold can be
    pinned at) find their pages in the heap after the first few, where glibc by default maps
    every such block afresh and faults all its pages in, every step. In a child process: the
    pinning lasts for the process."""
    script = """
import resource, sys
import torch
from bench.malloc import pin_malloc
print(pin_malloc() if sys.argv[1] == "pinned" else "default")
for _ in range(8):
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a, b = torch.full((1 << 24,), 1.0), torch.full((1 << 24,), 2.0)
    del a, b
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
"""
    faults = {}
    for mode in ("pinned", "default"):
        out = subprocess.run(
            [sys.executable, "-c", script, mode],
            cwd=Path(__file__).parents[2],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        faults[mode] = int(out[-1])
        if mode == "pinned":
            assert out[0:3] == ["glibc", "thresholds", "pinned"]  # this suite runs on glibc
    assert faults["pinned"] < 100 < 8192 < faults["default"], faults  # 8192 pages: 32 MiB


def _timed_softmax(**costs) -> DeviceProfile:
    """A device whose Megatron softmax costs 4 ns (forward) and 8 ns (backward) an element."""
    return DeviceProfile(
        "d",
        {"fp32": 1e11},
        3e10,
        5e-6,
        softmax={"forward": 4e-9, "backward": 8e-9, **costs},
        vector=5e10,
    )


def test_a_timed_softmax_prices_the_baseline_and_what_the_fused_softmax_changes():
    """Where the device's softmaxes were timed (tools/bench_overhead.py), the baseline step pays
    Megatron's softmax at its measured cost, and the fused softmax costs its screen (the scores) and
    its pass (the context) plus, once on the steps that run it, its difference to Megatron's."""
    shape = ModelShape("m", 4, 512, 8, 2048, 1024, seq=512, dtype="fp32")
    elements = 8 * 512**2
    plain = _timed_softmax()
    untimed = replace(plain, softmax=None)
    baseline = step_time(shape, untimed) - 4 * sum(
        softmax_seconds(shape, untimed, p) for p in ("forward", "backward")
    )
    assert step_time(shape, plain) == pytest.approx(baseline + 4 * elements * 12e-9)
    # the fused softmax as fast as Megatron's softmax, its checks free: the fused figures are
    # the checks'
    even = predict(shape, plain, "fused")
    assert even.step == pytest.approx(sum(even.sections.values()))
    faster = replace(
        plain,
        softmax={**plain.softmax, "fused_softmax_forward": -2e-9, "fused_softmax_backward": -3e-9},
    )
    swap = 4 * elements * (-2e-9 - 3e-9) / step_time(shape, plain)
    fast = predict(shape, faster, "fused")
    for s in FORWARD_SECTIONS:
        assert fast.sections[s] == pytest.approx(
            even.sections[s] + swap * (s in ("scores", "context"))
        )
    assert fast.step == pytest.approx(even.step + swap)  # once, whichever sections run it
    checks = replace(faster, softmax={**faster.softmax, "screen": 1e-9, "pass": 2e-9})
    checked = predict(shape, checks, "fused")
    base = step_time(shape, checks)
    assert checked.sections["scores"] == pytest.approx(
        fast.sections["scores"] + 4 * elements * 1e-9 / base
    )
    assert checked.sections["context"] == pytest.approx(
        fast.sections["context"] + 4 * elements * 2e-9 / base
    )
    assert checked.sections["qkv"] == fast.sections["qkv"]
    # scores every 2 steps, context every 3: the fused softmax runs on 2 steps of 3
    sparse = predict(shape, checks, "fused", intervals={"scores": 2, "context": 3})
    others = sum(checked.sections[s] for s in ("qkv", "proj"))
    own = (checked.sections["scores"] - swap) / 2 + (checked.sections["context"] - swap) / 3
    assert sparse.step == pytest.approx(others + own + swap * 2 / 3)
    # the implementations without the fused softmax keep Megatron's softmax
    assert predict(shape, checks, "kernels").sections == predict(shape, plain, "kernels").sections


def test_the_cpus_checks_apart_are_the_kernels_checks_with_the_fused_softmax_on_scores_steps():
    """``apart`` (a CPU's route, guard.checks_apart): every GEMM checked as by ``kernels``, no
    screen or pass priced, and the fused softmax's difference to Megatron's softmax on the steps
    that check the scores, which alone run it."""
    shape = ModelShape("m", 4, 512, 8, 2048, 1024, seq=512, dtype="fp32")
    elements = 8 * 512**2
    timed = _timed_softmax()
    device = replace(
        timed,
        softmax={
            **timed.softmax,
            "fused_softmax_forward": -2e-9,
            "fused_softmax_backward": -3e-9,
            "screen": 1e-9,
            "pass": 2e-9,
        },
    )
    kernels, apart = predict(shape, device, "kernels"), predict(shape, device, "apart")
    swap = 4 * elements * (-2e-9 - 3e-9) / step_time(shape, device)
    for s in FORWARD_SECTIONS:
        assert apart.sections[s] == pytest.approx(kernels.sections[s] + swap * (s == "scores"))
    assert apart.step == pytest.approx(kernels.step + swap)
    assert protection_forward(shape, "apart") == protection_forward(shape, "kernels")
    # the context alone runs Megatron's softmax; the scores every 2 steps, the fused softmax on half
    alone = predict(shape, device, "apart", sections=("context",))
    assert alone.step == pytest.approx(kernels.sections["context"])
    sparse = predict(shape, device, "apart", intervals={"scores": 2})
    others = sum(kernels.sections[s] for s in ("qkv", "context", "proj"))
    assert sparse.step == pytest.approx(others + kernels.sections["scores"] / 2 + swap / 2)


@pytest.mark.parametrize("intervals", [[], [1], [2, 3], [4, 6], [3, 3], [5, 7, 2]])
def test_the_share_of_steps_that_run_the_fused_softmax_counts_the_steps(intervals):
    period = math.lcm(*intervals) if intervals else 1
    due = sum(any(step % n == 0 for n in intervals) for step in range(period))
    assert _share_of_steps(intervals) == pytest.approx(due / period)


def test_a_softmax_profile_names_its_parts():
    every = DeviceProfile(
        "d", {"fp32": 1e11}, 3e10, 5e-6, softmax=dict.fromkeys(SOFTMAX_PARTS, 1e-9)
    )
    assert softmax_seconds(SHAPES["GPT-3 125M"], every, "pass") > 0
    with pytest.raises(ValueError, match="give forward and backward"):
        DeviceProfile("d", {"fp32": 1e11}, 3e10, 5e-6, softmax={"forward": 1e-9})
    with pytest.raises(ValueError, match="softmax parts"):
        _timed_softmax(fused=1e-9)
    with pytest.raises(ValueError, match="softmax part 'mask'"):
        softmax_seconds(SHAPES["GPT-3 125M"], DEVICES["H100"], "mask")


def test_the_benchmark_times_both_softmaxes_and_the_fused_ones_checks():
    """bench_overhead's softmax costs, per element of S: Megatron's module both ways, and with
    the kernels what the fused softmax's screen and pass add; the report's profile takes them."""
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import attention_mask_func

    from bench.overhead import parse_args, softmax_costs
    from bench.overhead_report import calibrated
    from megatron_abft.cpu import enable_cpu_mode
    from megatron_abft.ops import compiled

    enable_cpu_mode()  # Megatron makes its causal mask on the GPU
    module = FusedScaleMaskSoftmax(
        False, False, AttnMaskType.causal, False, attention_mask_func, True, None
    )
    args = parse_args(["--hidden", "64", "--heads", "2", "--seq", "64", "--block", "32"])
    cpu = torch.device("cpu")
    costs = softmax_costs(module, args, cpu)
    both = {"forward", "backward"}
    assert set(costs) == (both | {"screen", "pass"} if compiled.available() else both)
    assert (
        all(0 <= c < 1e-5 for c in costs.values()) and min(costs["forward"], costs["backward"]) > 0
    )
    with compiled.disabled():
        assert set(softmax_costs(module, args, cpu)) == {"forward", "backward"}
    run = json.loads(RUN4.read_text())
    assert calibrated(run).softmax is None  # from before the softmax was timed
    run["machine"]["softmax"] = costs
    assert calibrated(run).softmax == costs


def test_the_decomposed_modes_skip_the_checks_or_their_screens_and_restore_them():
    """--decompose: "skipped" leaves a corrupted output unverified, "unread" lets the CPU's screen
    pass it unread (the check ends there), and both put the real ones back; flash refuses it."""
    from bench.overhead import DECOMPOSED, decomposed, parse_args, timed_modes
    from megatron_abft.check.eec import GemmOperands
    from megatron_abft.config import ABFTConfig
    from megatron_abft.ops import compiled
    from megatron_abft.runtime.guard import SectionGuard

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(32, 64, generator=g), torch.randn(192, 64, generator=g)  # the bench's qkv
    clean = x @ w.t()
    guard = SectionGuard("qkv", ABFTConfig(), 0)

    def checked(mode: str) -> torch.Tensor:
        y = clean.clone()
        y[3, 5] += 100.0
        with decomposed(mode):
            guard.check(y, GemmOperands(x, w.t()))
        return y

    assert torch.allclose(checked("all"), clean)  # corrected
    assert checked("skipped")[3, 5] == clean[3, 5] + 100.0
    if compiled.available():  # the screen decides a clean check on the CPU
        assert checked("unread")[3, 5] == clean[3, 5] + 100.0
    assert torch.allclose(checked("all"), clean)  # the real ones back
    args = parse_args(["--decompose", "--no-per-section"])
    assert [name for name, _ in timed_modes(args)] == ["off", "all", *DECOMPOSED]
    with pytest.raises(SystemExit):
        parse_args(["--decompose", "--attention", "flash"])


def _fused_softmax_swap_worker():
    from mcore import Shape, batch, build_gpt

    from bench.overhead import fused_softmax_swap
    from megatron_abft.config import ABFTConfig
    from megatron_abft.spec import get_gpt_layer_abft_spec

    model = build_gpt(Shape(), get_gpt_layer_abft_spec(ABFTConfig(sections=())))
    tokens, positions, mask, labels = batch(Shape(), 0)
    calls = []

    def forward_backward():
        """A step whose times say which softmax ran: 1 s and 2 s with the fused softmax, else
        3 and 5."""
        with torch.profiler.profile() as profile:
            model(tokens, positions, mask, labels=labels).float().mean().backward()
        ran = sum(e.name == "megatron_abft::softmax_check" for e in profile.events())
        calls.append(ran)
        return (1.0, 2.0) if ran else (3.0, 5.0)

    swap = fused_softmax_swap(model, forward_backward, pairs=3)
    cores = [layer.self_attention.core_attention for layer in model.decoder.layers]
    return swap, calls, any({"_softmax_reader", "forward"} & set(vars(core)) for core in cores)


def _time_checks_worker(route: str):
    from mcore import Shape, batch, build_gpt

    from bench.overhead import per_check, time_checks
    from bench.timing import Timer
    from megatron_abft import set_step
    from megatron_abft.config import ABFTConfig
    from megatron_abft.runtime import guard
    from megatron_abft.spec import get_gpt_layer_abft_spec

    if route == "screen":  # the fused softmax's screen and P's pass, as on a GPU
        guard.checks_apart = lambda *_: False
    config = ABFTConfig(fused_softmax=route != "megatron")
    model = build_gpt(Shape(), get_gpt_layer_abft_spec(config))
    tokens, positions, mask, labels = batch(Shape(), 0)
    spans = {s: [] for s in FORWARD_SECTIONS}
    timing = {"on": False, "step": 0}
    time_checks(model, Timer(False), spans, timing)
    counts = []
    for step, on in ((0, False), (1, True), (2, True)):
        set_step(model, step)
        timing.update(on=on, step=step)
        model(tokens, positions, mask, labels=labels).float().mean().backward()
        counts.append({s: len(v) for s, v in spans.items()})
    layers = Shape().layers
    return counts, spans, {s: per_check(v, Timer(False), layers) for s, v in spans.items()}


@pytest.mark.parametrize("route", ["megatron", "apart", "screen"])
def test_the_benchmark_times_every_piece_of_a_check(route):
    """Spawns 1 rank. While timing is on, each due check's pieces are timed under its section,
    a layer each: the guards' checks and, with the fused softmax's screen (as on a GPU), what runs
    outside them, the scores' references (screen_sides) and the context's from P's pass
    (pair_vectors, encode_from_pass); nothing while it is off. On the CPU, with the fused softmax as
    the softmax, the checks are apart (guard.checks_apart): one piece each. A check's time is
    its pieces summed a step, shared over the layers, the median over the steps."""
    from megatron_abft.ops import compiled

    if route != "megatron" and not compiled.available():
        pytest.skip("the fused softmax needs the compiled kernels")
    (found,) = spawn(1, 1, _time_checks_worker, route)
    if isinstance(found, Exception):
        raise found
    counts, spans, seconds = found
    layers = Shape().layers
    pieces = {"qkv": 1, "scores": 1, "context": 3 if route == "screen" else 1, "proj": 1}
    assert counts == [
        dict.fromkeys(FORWARD_SECTIONS, 0),
        {s: layers * n for s, n in pieces.items()},
        {s: 2 * layers * n for s, n in pieces.items()},
    ]
    for section, timed in spans.items():
        steps = [sum(end - begin for step, begin, end in timed if step == s) for s in (1, 2)]
        assert seconds[section] == pytest.approx(statistics.median(steps) / layers)
        assert all(step in (1, 2) and end >= begin for step, begin, end in timed)


def test_fused_softmax_swap_times_steps_with_each_softmax_in_turns():
    """Spawns 1 rank. Each pair runs one step with the fused softmax as every layer's softmax and
    one with Megatron's, in turns first; the swap is their difference a layer, and the model is left
    as it was."""
    from megatron_abft.ops import compiled

    if not compiled.available():
        pytest.skip("the fused softmax needs the compiled kernels")
    (found,) = spawn(1, 1, _fused_softmax_swap_worker)
    if isinstance(found, Exception):
        raise found
    swap, calls, left_patched = found
    layers = Shape().layers
    assert calls == [layers, 0, 0, layers, layers, 0, 0, layers]
    assert swap == pytest.approx(((1 - 3) / layers, (2 - 5) / layers))
    assert not left_patched


def test_the_benchmark_calibrates_on_the_median_of_its_rounds():
    from bench.overhead import median_rates

    rounds = [
        {"matmul": 1e11, "launches": None, "softmax": {"forward": 3e-9}},
        {"matmul": 3e11, "launches": None, "softmax": {"forward": 1e-9}},
        {"matmul": 2e11, "launches": None, "softmax": {"forward": 2e-9}},
    ]
    assert median_rates(rounds) == {"matmul": 2e11, "launches": None, "softmax": {"forward": 2e-9}}


def test_work_arithmetic_and_time():
    w = Work(2e12, 1e9, 10, 4) + Work(2e12, 1e9, 10, 4) * 0.5
    assert (w.flops, w.bytes, w.ops, w.dots) == (3e12, 1.5e9, 15, 6)
    device = DeviceProfile("d", {"bf16": 1e12}, 1e9, 1e-3)
    assert device.time(w, "bf16") == pytest.approx(3 + 1.5 + 0.015)
    assert step_time(SHAPES["GPT-3 125M"], DEVICES["A100"]) > 0


def test_a_baseline_scale_stretches_the_forward_and_backward_not_the_checks():
    """DeviceProfile.baseline_scale multiplies the baseline's forward and backward (and so the
    attention block's forward), never Adam's update nor the checks: the overheads shrink by as
    much as the step grows."""
    shape = replace(SHAPES["GPT-3 125M"], seq=1024)
    plain = DEVICES["A100"]
    slow = replace(plain, baseline_scale=1.5)
    counted = forward_backward_time(shape, plain)
    assert forward_backward_time(shape, slow) == counted  # the count, before the scale
    assert step_time(shape, slow) - step_time(shape, plain) == pytest.approx(0.5 * counted)
    fast, stretched = predict(shape, plain, "kernels"), predict(shape, slow, "kernels")
    base = stretched.step_seconds / fast.step_seconds
    assert stretched.step == pytest.approx(fast.step / base)
    assert stretched.attention == pytest.approx(fast.attention / 1.5)
    for section in FORWARD_SECTIONS:
        assert stretched.sections[section] == pytest.approx(fast.sections[section] / base)
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="baseline_scale"):
            replace(plain, baseline_scale=bad)


def test_a_benchmark_run_calibrates_the_baseline_on_its_unprotected_steps():
    """overhead_report's profile of a run: the baseline's forward and backward at what the run's
    "off" steps took (step less optimizer), Adam at the run's optimizer bandwidth; the
    roofline's own step is kept for its row."""
    from bench.overhead_report import calibrated, measured_shape, roofline, validation_rows

    run = json.loads(RUN4.read_text())
    shape, off = measured_shape(run["args"]), run["median"]["off"]
    device = calibrated(run)
    assert device.baseline_scale != 1.0 and roofline(run).baseline_scale == 1.0
    assert device.baseline_scale * forward_backward_time(shape, device) == pytest.approx(
        off["step"] - off["optimizer"]
    )
    adam = step_time(shape, device) - device.baseline_scale * forward_backward_time(shape, device)
    assert adam == pytest.approx(off["optimizer"], rel=0.05)  # its bandwidth is the run's
    (row,) = [r for r in validation_rows([RUN4]) if r["what"] == "baseline step, roofline"]
    assert row["predicted"] == step_time(shape, roofline(run)) and row["ok"] is None
    assert row["measured"] == off["step"]


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="dtype: 'int8'"):
        ModelShape("m", 1, 64, 4, 256, 100, dtype="int8")
    with pytest.raises(ValueError, match="must divide"):
        ModelShape("m", 1, 64, 3, 256, 100)


@pytest.mark.parametrize("impl", ["kernels", "torch"])
def test_the_op_counts_the_model_assumes_are_the_code_s(impl):
    """CHECK_OPS follows the code: a clean check of a batched GEMM launches that many ops
    (counted by torch.profiler, as tools/bench_overhead.py does), within 15%."""
    from contextlib import nullcontext

    from bench.overhead import check_cost
    from megatron_abft.ops import compiled

    if impl == "kernels" and not compiled.available():
        pytest.skip(compiled.backend())
    with compiled.disabled() if impl == "torch" else nullcontext():
        ops, seconds = check_cost(torch.device("cpu"), reps=3)
    assert ops == pytest.approx(CHECK_OPS[impl], rel=0.15)
    assert seconds > 0


@pytest.mark.parametrize("impl", ["kernels", "torch"])
def test_a_bias_adds_the_ops_the_model_counts(impl):
    """BIAS_OPS follows the code: a guard's clean check of a GEMM with a bias launches that many
    ops more than without on a CPU, within 15% (none with the kernels: check_gemm adds the
    bias's terms inside its op); the model adds them to the qkv check of a model with biases
    only, and a GPU's profile its add_bias launch (BIAS_KERNELS)."""
    from contextlib import nullcontext

    from bench.overhead import bias_ops
    from megatron_abft.ops import compiled

    if impl == "kernels" and not compiled.available():
        pytest.skip(compiled.backend())
    with compiled.disabled() if impl == "torch" else nullcontext():
        assert bias_ops(torch.device("cpu")) == pytest.approx(BIAS_OPS[impl], rel=0.15)
    gpt = SHAPES["GPT-3 350M"]
    for shape, more in ((gpt, BIAS_OPS[impl]), (replace(gpt, bias=False), 0)):
        ops = {s: w.ops for s, w in protection_forward(shape, impl).items()}
        assert ops == {
            **dict.fromkeys(FORWARD_SECTIONS, CHECK_OPS[impl]),
            "qkv": CHECK_OPS[impl] + more,
        }
    h200 = DEVICES["H200"]
    on_gpu = protection_forward(gpt, impl, h200.ops_per_check(impl), h200.ops_per_bias(impl))
    assert on_gpu["qkv"].ops == CHECK_KERNELS[impl] + BIAS_KERNELS[impl]
    assert not SHAPES["Llama-3 8B"].bias


def test_the_report_judges_every_measured_row_and_sums_them_up():
    """tools/overhead_report.py on a committed benchmark run: each overhead row is judged by
    the tolerance (±25% or ±1 pp, the looser), each check row by ±25%, and the summary counts
    the rows that agree."""
    from bench.overhead_report import summary, validation_rows

    rows = validation_rows([RUN4])
    judged = [r for r in rows if r["ok"] is not None]
    assert [r["what"] for r in judged] == [
        *FORWARD_SECTIONS,
        "step, all",
        "attention, all",
        *(f"{s} check" for s in FORWARD_SECTIONS),
        "checks' own time, all",
    ]
    for r in judged:
        error, measured = abs(r["predicted"] - r["measured"]), abs(r["measured"])
        allowed = 0.25 * measured if r["unit"] == "ms" else max(0.25 * measured, 0.01)
        assert r["ok"] == (error <= allowed), r
    agree = sum(r["ok"] for r in judged)
    assert summary(rows)[0] == f"{agree} of {len(judged)} rows agree within the tolerance."
    own = [r for r in rows if r["what"] == "checks' own time, all"][0]
    assert own["measured"] == pytest.approx(0.0584, abs=0.0005)  # 4 layers x 5.83 ms / 0.400 s
    assert any(f"add up to {100 * own['measured']:.0f}%" in line for line in summary(rows))
    assert "model's alone" in summary([])[0]


def test_gpus_count_kernel_launches_and_a_run_is_judged_on_its_own_op_count():
    """The GPU profiles cost a check's kernel launches (CHECK_KERNELS), a CPU its top-level ops
    (CHECK_OPS); a benchmark run is predicted with the ops its own code launched, as counted in
    that run (a bias's too, where the run counted them)."""
    from bench.overhead_report import calibrated, measured_shape

    assert DEVICES["H100"].ops_per_check("kernels") == CHECK_KERNELS["kernels"]
    run = json.loads(RUN4.read_text())
    device = calibrated(run)
    assert device.ops_per_check("kernels") == run["machine"]["check_ops"] == 13
    assert device.ops_per_check("torch") == CHECK_OPS["torch"]
    assert device.ops_per_bias("kernels") == 1  # its code's add_bias, an op of its own then
    shape = measured_shape(run["args"])
    work = protection_forward(shape, "kernels", 13, device.ops_per_bias("kernels"))
    assert {s: w.ops for s, w in work.items()} == {**dict.fromkeys(FORWARD_SECTIONS, 13), "qkv": 14}
    llama = protection_forward(SHAPES["Llama-2 7B"], "kernels")  # no bias
    assert {w.ops for w in llama.values()} == {CHECK_OPS["kernels"]}
    # the fused path's context: references by pair_vectors and encode_pair_from, verify_correct
    fused = protection_forward(SHAPES["Llama-2 7B"], "fused", CHECK_KERNELS["fused"])
    assert {s: w.ops for s, w in fused.items()} == {
        **dict.fromkeys(FORWARD_SECTIONS, 3),
        "context": 4,
    }


def test_the_report_explains_a_fused_section_the_model_misses():
    """summary() adds why, where the fused softmax's sections disagree in a run that did not time
    the softmaxes, and says nothing of it where they agree or the run timed them."""
    from bench.overhead_report import summary

    def row(config, what, predicted, measured, ok):
        return {
            "config": config,
            "what": what,
            "predicted": predicted,
            "measured": measured,
            "ok": ok,
            "unit": "%",
            "interval": 0.01,
        }

    rows = [
        row("cpu (fused)", "scores", 0.008, -0.013, False),
        row("cpu (fused)", "step, all", 0.043, 0.038, True),
        row("cpu (fused)", "attention, all", 0.32, 0.26, True),
    ]
    text = " ".join(summary(rows))
    assert "2 of 3 rows agree" in text and "masked_fill" in text
    rows[0]["softmax_timed"] = True  # a run that timed the softmaxes: the model counts the saving
    assert "masked_fill" not in " ".join(summary(rows))
    rows[0]["softmax_timed"], rows[0]["ok"] = False, True
    assert "masked_fill" not in " ".join(summary(rows))


def test_the_read_benchmark_times_every_matrix_cold_and_warm():
    """bench_reads: each matrix's bytes and its read times in no cache and warm; V in three
    layouts holding the same values, the first a view of the qkv output; None without the
    kernels."""
    from bench.reads import attention_values, measure, parse_args
    from megatron_abft.ops import compiled

    values = attention_values(seq=8, hidden=32, heads=2)
    first, *others = values.values()
    assert first.shape == (1, 2, 8, 16) and first.stride(-2) == 2 * 3 * 16
    assert all(torch.equal(first, other) for other in others)
    args = parse_args(["--seq", "64", "--hidden", "128", "--heads", "2", "--sizes", "0.25"])
    args.reps, args.block = 3, 32
    if compiled.available():
        reads = measure(args)["reads"]
        assert list(reads) == ["0.25 MiB contiguous", *values]
        assert reads["0.25 MiB contiguous"]["bytes"] == 2**18
        assert reads["V contiguous"]["bytes"] == 64 * 128 * 4
        assert all(r["cold"] > 0 and r["warm"] > 0 for r in reads.values())
    with compiled.disabled():
        assert measure(args) is None


def test_the_model_and_its_tiles_import_no_triton():
    """The overhead model reads the flash kernels' tile table (megatron_abft.flash.tiles) and its
    device profiles (devices.json) without importing Triton, which the launcher needs."""
    code = (
        "import sys; import megatron_abft.tuning.scaling, megatron_abft.tuning.devices, "
        "megatron_abft.tuning.flash_work, megatron_abft.flash.tiles; "
        "print('triton' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr[-2000:]


def test_the_report_sets_both_attentions_side_by_side_as_predictions():
    """overhead_report: the flash table, a row a catalogue model and sequence with every
    section; the side-by-side table, both attentions on every GPU profile at every micro-batch
    with the unfused attention's S, a column pair a profile by its DEVICES name; text that
    says which of the flash figures are datasheet rates and where one was measured."""
    from bench.overhead_report import (
        MICRO_BATCHES,
        SEQUENCES,
        flash_example,
        flash_method,
        flash_table,
        paths_table,
    )

    device = DEVICES["H100"]
    flash = flash_table(device)
    assert len(flash) == 2 + len(CATALOGUE) * len(SEQUENCES)
    assert all(f" {s} " in flash[0] for s in SECTIONS)
    p = predict(replace(SHAPES["GPT-3 350M"], seq=2048), device, "flash")
    row = next(line for line in flash if line.startswith("| GPT-3 350M | 1 | 2048 |"))
    assert f"**{100 * p.step:.2f}%**" in row and f"| {100 * p.shared:.2f}% |" in row
    paths = paths_table(device)
    assert len(paths) == 2 + len(CATALOGUE) * len(SEQUENCES) * len(MICRO_BATCHES)
    assert all(f"| {key} unfused | {key} flash |" in paths[0] for key in DEVICES)
    row = next(line for line in paths if line.startswith("| GPT-3 350M | 1 | 2048 | 8 |"))
    assert "| 1.00 GiB |" in row
    text = " ".join(flash_method() + flash_example(device))
    assert "from datasheets" in text and "H200 runs of GPT-3 350M" in text


def test_a_gpu_prices_a_large_bf16_projections_products_on_the_tensor_cores():
    """On a GPU a 2-D bf16 GEMM whose larger operand has MMA_PRODUCTS_MIN_ELEMENTS takes its
    products as cuBLAS GEMMs (csrc/bindings/abft_mma_products.cpp): its sides' work is tensor-core
    FLOPs, the library ops' bytes and launches (MMA_PRODUCTS_OPS a side) in place of the products
    kernel's multiply-adds and its launch; the attention's batched GEMMs, fp16, a GEMM below the
    threshold and a CPU keep the products kernel."""
    gpt = replace(SHAPES["GPT-3 350M"], seq=2048, micro_batch=8)  # qkv's X: 16384 x 1024
    ops = (CHECK_KERNELS["kernels"], BIAS_KERNELS["kernels"])
    cores = protection_forward(gpt, "kernels", *ops)
    tensor = protection_forward(gpt, "kernels", *ops, gpu=True)
    for section in ("qkv", "proj"):
        assert cores[section].vector > 0 and cores[section].flops == 0
        assert tensor[section].vector == 0 and tensor[section].flops > 0
        assert tensor[section].launches == 2 * MMA_PRODUCTS_OPS
        assert tensor[section].ops == cores[section].ops - 1
        # each operand times 3 parts of the two sums of each of the other's blocks, and its |.|
        # times those of the block's size
        m, k, n = 16384, 1024, (3 * 1024 if section == "qkv" else 1024)
        vectors = (9 * -(-m // gpt.block), 9 * -(-n // gpt.block))  # against W's rows, X's
        assert tensor[section].flops == 2 * k * (vectors[0] * n + vectors[1] * m)
    for section in ("scores", "context"):
        assert tensor[section] == cores[section]
    for shape in (replace(gpt, dtype="fp16"), replace(gpt, micro_batch=1)):
        assert protection_forward(shape, "kernels", *ops, gpu=True) == protection_forward(
            shape, "kernels", *ops
        )
    assert MMA_PRODUCTS_MIN_ELEMENTS > 2048 * 1024  # micro-batch 1's X stays on the CUDA cores
