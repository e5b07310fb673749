"""Device profiles for the overhead model (megatron_abft.tuning.scaling): what a device sustains
(matmul FLOP/s, bandwidth, an op's latency, the flash kernels' CUDA-core and exp2 rates), loaded
from devices.json with each profile's provenance, and the ops one clean check costs on a CPU
(CHECK_OPS) and on a GPU (CHECK_KERNELS)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from megatron_abft.tuning.shapes import Work

CHECK_OPS = {"torch": 124, "kernels": 1, "fused": 4}
"""The host's calls into compiled code of one clean check of a batched GEMM on a CPU (tensor ops,
and the screen that is none), as a guard runs it once it has chosen the checker of its shape
(megatron_abft.check.checker): with the kernels, check_gemm's screen alone
(compiled.screen_passes: both sides encoded and screened in one call; check_gemm follows only
where it flags). The torch and kernels figures are the code's own, counted by
tests/tuning/test_scaling.py as tools/bench_overhead.py counts them; the fused path removes
passes, not ops. Runs of earlier code are priced at the counts their JSON recorded."""
CHECK_KERNELS = {"torch": CHECK_OPS["torch"], "kernels": 5, "fused": 3}
"""GPU kernels one clean check launches sync-free (the default where the kernels serve the GPU).
Measured on an H200 (bench/overhead.py's check_kernels, docs/benchmarks.md): 5, one more
than the code's count, which tests/ops/test_ext_tally.py names on the next GPU run. Counted from the
code: encode_pair 2 (both operands' block sums, then both
products, alpha applied as they are written; a column-major operand, as V^T is for the context,
read column by column) and verify_correct_tally 2 (C's block sums, each tile screening the
vectors it completes; the correction and the guard's tally in one thread block). A GEMM with a
bias (GPT's qkv) adds 1 (BIAS_KERNELS). Where the other operand has more than 8 blocks (16
vectors of a kind), the products kernel reads a row again for each 16 more, from the cache: not
modelled. The fused path drops C's block sums: the scores' check is encode_pair 2
and softmax_correct_tally's correction 1 (its screen in the softmax's own launch); the
context's takes one more (FUSED_CONTEXT_OPS); the torch path is taken at its op count."""
BIAS_OPS = {"torch": 30, "kernels": 0, "fused": 0}
"""What a bias adds to a check (GPT's qkv; ModelShape.bias) in ops on a CPU: the torch path's
terms, counted with torch.profiler by tests/tuning/test_scaling.py; none with the kernels, whose
check_gemm adds them (add_bias) inside its one op."""
BIAS_KERNELS = {"torch": 30, "kernels": 1, "fused": 1}
"""What a bias adds to a check in launches on a GPU (and in ops on the code before check_gemm):
the kernels' add_bias, one launch."""

SOFTMAX_PARTS = (
    "forward",
    "backward",
    "fused_softmax_forward",
    "fused_softmax_backward",
    "screen",
    "pass",
)
"""What a device profile may time of the scale-mask-softmax, per element of S: Megatron's softmax
forward and backward; what the fused softmax (megatron_abft.ops.fused_softmax) with no checks adds
to each, inside a training step (negative where it is faster); and what each of the fused softmax's
checks adds to its forward: the screen of S (the scores' check) and the pass over P (the context's
encoding)."""


@dataclass(frozen=True)
class DeviceProfile:
    """What a device sustains: matrix FLOP/s per dtype, memory bandwidth, and the latency of one
    tensor op (kernel launch or eager-op dispatch)."""

    name: str
    matmul: dict[str, float]
    bandwidth: float
    launch: float
    notes: str = ""
    check_op: float | None = None
    """Latency of one of the checks' ops, the Python around it included (default: launch)."""
    optimizer_bandwidth: float | None = None
    """Bandwidth of the optimizer step's traffic (default: bandwidth). Calibrated apart on CPUs,
    where a parameter's Adam passes run from the cache."""
    check_ops: dict[str, float] | None = None
    """Ops of one clean check per implementation, each at ``check_op`` (default CHECK_OPS)."""
    bias_ops: dict[str, float] | None = None
    """What a bias adds to a check, in those ops (default BIAS_OPS)."""
    check_bandwidth: float | None = None
    """Rate at which the checks' kernels read a matrix that is in no cache, as a check reads its
    GEMM's output in a step (default: bandwidth). Calibrated apart on CPUs, where the kernels
    do several sums per element and read well below a plain stream."""

    softmax: dict[str, float] | None = None
    """Seconds per element of S of the parts of the scale-mask-softmax (SOFTMAX_PARTS), measured
    on the device by tools/bench_overhead.py; ``forward`` and ``backward`` at least. Without them
    the softmax is priced by its bytes, the fused softmax as fast as Megatron's, and the fused
    softmax's checks at nothing of their own: the fused path takes its sums while it reads S
    anyway."""
    check_dot: float = 0.0
    """Seconds of one of the checks' dot products beyond its multiply-adds (Work.dots): on a CPU
    the horizontal sum that ends it and the loop around it, which cost the kernels more than
    the multiply-adds of an operand head_dim wide. Calibrated on CPUs by bench_overhead; 0 on
    GPUs, where a products kernel's reductions run in parallel with its reads."""
    baseline_scale: float = 1.0
    """The unprotected step's forward and backward as measured on the device, over their time
    as the model counts them at this profile's rates (forward_backward_time): 1 takes the
    roofline as it is, as the datasheet profiles do. Calibrated on a CPU from the benchmark's
    unprotected steps (tools/overhead_report.py), where a layer's own small GEMMs, RoPE and
    elementwise passes run below the micro-benchmarks' rates. It scales the baseline, never
    the checks, which are priced by their own rates."""
    vector: float | None = None
    """fp32 ops a second on the CUDA cores (Work.vector): an add, multiply, max, compare or cast
    each, an FMA one, so half the datasheet's fp32 FLOP/s (which counts an FMA as two); on a
    CPU its vector units, at half the fp32 matmul rate it measured. The checksum products'
    multiply-adds run there, not on the tensor cores: fp32 sums of bf16 and fp16 operands. In
    the flash kernels the softmax's elementwise ops and the checks' row sums and comparisons
    run between the tile GEMMs, issued by the same warps as the softmax's exp2: an FA2-style
    kernel (no warp specialisation, unlike FlashAttention-3) does not overlap them with the
    tensor cores, so the model adds their times to the GEMMs'. None: not known, and work that
    needs it is refused."""
    exp: float | None = None
    """exp2 a second on the special-function units (MUFU), the flash softmax's exponentials
    (Work.exps): 16 a clock an SM on sm_80 and sm_90, which on an H100 SXM is 3.9 T/s against
    989 TFLOP/s of bf16 matmul (FlashAttention-3, arXiv 2407.08608, section 3): at head dim 64
    the forward's exp2 take as long as its GEMMs. None: not known (a CPU's), and the flash
    path is not priced."""

    def __post_init__(self) -> None:
        if not self.baseline_scale > 0:
            raise ValueError(f"DeviceProfile {self.name}: baseline_scale {self.baseline_scale}")
        if not self.check_dot >= 0:
            raise ValueError(f"DeviceProfile {self.name}: check_dot {self.check_dot}")
        if self.softmax is not None:
            unknown = set(self.softmax) - set(SOFTMAX_PARTS)
            if unknown or not {"forward", "backward"} <= set(self.softmax):
                raise ValueError(
                    f"DeviceProfile {self.name}: softmax parts {sorted(self.softmax)}; give "
                    f"forward and backward, and any of {', '.join(SOFTMAX_PARTS[2:])}"
                )

    @property
    def gpu(self) -> bool:
        """A GPU's profile, where the checks run the CUDA kernels and cuBLAS: one that prices
        exp2 on the special-function units, which a CPU's leaves unknown."""
        return self.exp is not None

    def ops_per_check(self, impl: str) -> float:
        return (self.check_ops or CHECK_OPS)[impl]

    def ops_per_bias(self, impl: str) -> float:
        return (self.bias_ops or BIAS_OPS)[impl]

    def time(self, work: Work, dtype: str) -> float:
        return sum(self._terms(work, dtype, self.bandwidth, self.launch).values())

    def check_time(self, work: Work, dtype: str) -> float:
        """Time of the checks' work: their bytes at ``check_bandwidth``, their ops at
        ``check_op``, their dot products at ``check_dot`` each."""
        return sum(self.check_terms(work, dtype).values())

    def check_terms(self, work: Work, dtype: str) -> dict[str, float]:
        """check_time by kind of work: tensor-core FLOPs, bytes, ops, dot products, CUDA-core
        ops, exponentials, and the library ops' bytes and launches (at the device's own
        bandwidth and launch latency: those ops are not the checksum kernels that check_bandwidth
        and check_op were measured on), in seconds."""
        op = self.launch if self.check_op is None else self.check_op
        bandwidth = self.check_bandwidth or self.bandwidth
        return self._terms(work, dtype, bandwidth, op) | {"dots": work.dots * self.check_dot}

    def _terms(self, work: Work, dtype: str, bandwidth: float, op: float) -> dict[str, float]:
        return {
            "flops": work.flops / self.matmul[dtype],
            "bytes": work.bytes / bandwidth,
            "ops": work.ops * op,
            "vector": self._at(work.vector, self.vector, "vector"),
            "exps": self._at(work.exps, self.exp, "exp"),
            "stream": work.stream / self.bandwidth,
            "launches": work.launches * self.launch,
        }

    def _at(self, amount: float, rate: float | None, name: str) -> float:
        """``amount`` at ``rate``; refused where work needs a rate the profile does not have."""
        if not amount:
            return 0.0
        if rate is None:
            raise ValueError(
                f"DeviceProfile {self.name} has no {name} rate, which this work needs: the "
                "checksum products take vector, the flash path vector and exp (DEVICES' GPU "
                "profiles have both)"
            )
        return amount / rate


GEMM_SHARE, MEMORY_SHARE = 0.7, 0.85
"""The fractions of a datasheet's peaks a device sustains: GEMMs and the flash kernels'
CUDA-core and exp2 rates, and memory."""

PROFILES = Path(__file__).with_name("devices.json")
"""The device profiles, each with its provenance: ``datasheet`` ones by their dense peaks
(``matmul_peak``, ``bandwidth_peak``, ``fp32_peak``, ``exp_peak``), ``measured`` ones by the
rates a benchmark measured, and the flash rates of the datasheet profile ``flash_rates_of``."""


_MEASURED_FIELDS = (
    "name",
    "matmul",
    "bandwidth",
    "launch",
    "notes",
    "check_op",
    "optimizer_bandwidth",
    "check_ops",
    "bias_ops",
    "check_bandwidth",
    "softmax",
)
"""The rates a measured profile gives as they are (``bias_ops``: BIAS_KERNELS where the run
counted none)."""


def _profile(entry: dict, datasheets: dict[str, DeviceProfile]) -> DeviceProfile:
    """A DeviceProfile from one entry of PROFILES: a datasheet's peaks at GEMM_SHARE and
    MEMORY_SHARE, a launch a check (CHECK_KERNELS, BIAS_KERNELS), CUDA-core ops at half the fp32
    FLOP/s (an FMA is one op); or a measured profile's rates as they are."""
    if entry["source"] == "datasheet":
        return DeviceProfile(
            entry["name"],
            {dtype: GEMM_SHARE * peak for dtype, peak in entry["matmul_peak"].items()},
            MEMORY_SHARE * entry["bandwidth_peak"],
            entry["launch"],
            entry["notes"],
            check_ops=CHECK_KERNELS,
            bias_ops=BIAS_KERNELS,
            vector=GEMM_SHARE * entry["fp32_peak"] / 2,
            exp=GEMM_SHARE * entry["exp_peak"],
        )
    flash = datasheets[entry["flash_rates_of"]]
    rates = {"bias_ops": BIAS_KERNELS} | {k: v for k, v in entry.items() if k in _MEASURED_FIELDS}
    return DeviceProfile(**rates, vector=flash.vector, exp=flash.exp)


def _load_devices() -> dict[str, DeviceProfile]:
    entries = json.loads(PROFILES.read_text())
    devices = {k: _profile(e, {}) for k, e in entries.items() if e["source"] == "datasheet"}
    for key, entry in entries.items():
        if entry["source"] != "datasheet":
            devices[key] = _profile(entry, devices)
    return {key: devices[key] for key in entries}


DEVICES: dict[str, DeviceProfile] = _load_devices()
"""The device profiles of PROFILES, by key: H100, H200 and A100 from their datasheets, and
H200-measured from a run on an H200."""
