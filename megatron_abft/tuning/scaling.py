"""The overhead model: what protection costs a training step, predicted from first principles.

For a model shape it counts, per layer and tensor-parallel rank, the baseline work of a training
step (FLOPs of every GEMM, bytes of the memory-bound ops, number of tensor ops) and the extra
work of each protected section, then turns work into time with a device profile
(``time = flops / matmul rate + bytes / bandwidth + ops * launch latency``, each term a roofline
limit of its own). Five implementations of the checks are modelled (IMPLEMENTATIONS), four of
the unfused attention (S and P materialised; UNFUSED) and the flash attention:

- ``torch``: the PyTorch path of megatron_abft.check.eec and .checksum, pass by pass: every
  fp32 copy, abs and reduction over C and the operands, as the code does them;
- ``kernels``: today's code with the compiled kernels (megatron_abft.ops.compiled): a clean check is
  two ops of them, encode_pair (the larger operand read once for its block sums and its
  checksum products, the smaller twice) and verify_correct (C read once for both sides, with
  the differences, thresholds and flags; a clean matrix needs nothing more);
- ``fused``: the fused softmax (megatron_abft.ops.fused_softmax): the softmax, which reads S
  and writes P anyway, also verifies S and emits P's sums, so the scores' verify pass and the
  context's read of P go. The code on CUDA: there a sync-free check of the scores takes
  softmax_correct_tally, the softmax's one kernel (where a band's column sums fit in a thread
  block) screening S, then one thread block that corrects a flagged matrix, redoes its P and P's
  pass from the corrected S and tallies, with no host read.
  The fused softmax also replaces Megatron's softmax, forward and backward: where a device profile
  has timed both softmaxes and the fused softmax's checks (SOFTMAX_PARTS, on the CPU), the
  difference is part of the cost; elsewhere both run at the bandwidth and the checks in the pass
  are free.
- ``apart``: the code on a CPU, where the host reads results (guard.checks_apart): every GEMM
  checked as by ``kernels``, and the fused softmax in place of Megatron's softmax, without a screen
  or a pass, on the steps that check the scores.
- ``flash``: the protected flash attention (megatron_abft.flash), for GPUs only. Its baseline is
  the same Triton kernels with the checks compiled out, in place of the unfused attention's
  scores, softmax and context (flash_baseline): tile GEMMs on the tensor cores, the softmax's
  exp2 on the special-function units and its other elementwise ops on the CUDA cores, and only
  O(seq * head_dim) bytes. Its checks (flash_protection, flash_shared) are tensor-core FLOPs (a
  16-wide reference MMA a tile or a program), CUDA-core ops (row sums and a program's
  comparisons), and what the step runs once whenever any flash section is due: the checksum
  tiles' launches and bytes, the backward's rounding of Delta, the dQ kernel's row identities,
  the kernels' second launches and the ledger's updates. qkv and proj are checked as by
  ``kernels``.

Every check also costs a number of small ops, each at the device's op latency: on a CPU the
top-level tensor ops of a clean check (CHECK_OPS, counted on the code by
tests/tuning/test_scaling.py; eager dispatch and the Python around it, which tools/bench_overhead.py
measures on the check itself), on a GPU the kernels a clean sync-free check launches
(CHECK_KERNELS). On a CPU each dot product of the kernels' checksum products (an operand's row
against one checksum vector) also costs a fixed time beyond its multiply-adds
(DeviceProfile.check_dot, measured by the benchmark): for an operand head_dim wide, as Q, K and V
are, that cost is most of the products'.

The unfused attention's backward pass is not protected: its protection costs forward work only,
while the baseline step is forward + backward (2x the GEMM FLOPs) + optimizer. The flash path
checks the attention's backward GEMMs too. docs/scaling.md validates the model
against tools/bench_overhead.py and reports predictions for common model shapes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from itertools import combinations
from pathlib import Path

from megatron_abft.config import DTYPE_NAMES, FLASH_SECTIONS, FORWARD_SECTIONS, SECTIONS
from megatron_abft.flash.tiles import GPU_DTYPES, WIDTH, blocks, padded_head_dim

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
UNFUSED = ("torch", "kernels", "apart", "fused")
"""How the unfused attention's checks run: the PyTorch path; today's code with the compiled
kernels (one read of C for both sides with the comparisons, one of the larger operand and two of
the smaller); the same checks with the fused softmax as the softmax (a CPU's); and the fused path
(the softmax pass verifies S and sums P, so those two reads go)."""
IMPLEMENTATIONS = (*UNFUSED, "flash")
"""UNFUSED, and the flash attention's checks inside its kernels (qkv and proj as ``kernels``)."""
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
Measured on an H200 (tools/bench_overhead.py's check_kernels, docs/benchmarks.md): 5, one more
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
FUSED_CONTEXT_OPS = 1
"""What the context's check in the fused path launches beyond CHECK_KERNELS["fused"] (the
scores'), counted from the code: its references come from P's pass by pair_vectors and
encode_pair_from (a launch each, as many as encode_pair's two), and it verifies C by
verify_correct_tally (two launches, where the scores' correction is one): 4, as many as a check
of today's kernels. A CPU is charged the same one op more (its two ops where encode_pair is one;
the views of P's pass that make the row side are ops there too, of next to no cost)."""
BIAS_OPS = {"torch": 30, "kernels": 0, "fused": 0}
"""What a bias adds to a check (GPT's qkv; ModelShape.bias) in ops on a CPU: the torch path's
terms, counted with torch.profiler by tests/tuning/test_scaling.py; none with the kernels, whose
check_gemm adds them (add_bias) inside its one op."""
BIAS_KERNELS = {"torch": 30, "kernels": 1, "fused": 1}
"""What a bias adds to a check in launches on a GPU (and in ops on the code before check_gemm):
the kernels' add_bias, one launch."""


@dataclass(frozen=True)
class ModelShape:
    """A GPT-style model, its sequence length, micro-batch and tensor parallelism."""

    name: str
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    seq: int = 2048
    micro_batch: int = 1
    tp: int = 1
    kv_groups: int | None = None
    """KV groups (GQA); None = one per head (MHA)."""
    gated: bool = False
    """SwiGLU MLP (three FFN matrices) instead of GeLU (two)."""
    tied_embeddings: bool = True
    """The output layer shares the input embedding (GPT-3); Llama's has its own."""
    bias: bool = True
    """The linear layers add a bias (GPT-3, Megatron's default); Llama's add none."""
    dtype: str = "bf16"
    block: int = 256
    """ABFT checksum block length."""

    def __post_init__(self) -> None:
        if self.dtype not in BYTES:
            raise ValueError(f"ModelShape.dtype: {self.dtype!r}; choose from {', '.join(BYTES)}")
        groups = self.kv_groups or self.heads
        if self.hidden % self.heads or self.heads % groups or self.heads % self.tp:
            raise ValueError(f"ModelShape {self.name}: hidden, heads, kv_groups and tp must divide")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def groups(self) -> int:
        return self.kv_groups or self.heads

    def parameters(self) -> int:
        """Parameter count (weights and biases of attention and MLP, norms, embeddings)."""
        hn = self.head_dim
        attention = self.hidden * (self.hidden + 2 * self.groups * hn) + self.hidden**2
        mlp = self.hidden * self.ffn * (3 if self.gated else 2)
        per_layer = attention + mlp + 4 * self.hidden
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * per_layer + embeddings


@dataclass(frozen=True)
class Work:
    """An amount of work: GEMM FLOPs, bytes moved by memory-bound ops, tensor ops launched, the
    dot products of the checks' products kernels (a row of an operand against one checksum
    vector; their multiply-adds are in ``flops``), and inside the flash kernels, fp32 ops on the
    CUDA cores (``vector``, an FMA one) and exponentials on the special-function units
    (``exps``)."""

    flops: float = 0.0
    bytes: float = 0.0
    ops: float = 0.0
    dots: float = 0.0
    vector: float = 0.0
    exps: float = 0.0

    def __add__(self, other: Work) -> Work:
        return Work(
            self.flops + other.flops,
            self.bytes + other.bytes,
            self.ops + other.ops,
            self.dots + other.dots,
            self.vector + other.vector,
            self.exps + other.exps,
        )

    def __mul__(self, factor: float) -> Work:
        return Work(
            self.flops * factor,
            self.bytes * factor,
            self.ops * factor,
            self.dots * factor,
            self.vector * factor,
            self.exps * factor,
        )


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

ADAM_BYTES_PER_PARAMETER = 16 * 4
"""Traffic of one Adam update per parameter, op by op as torch's foreach Adam does it."""


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
    """fp32 ops a second on the CUDA cores, the flash kernels' elementwise work (Work.vector): an
    add, multiply, max, compare or cast each, an FMA one, so half the datasheet's fp32 FLOP/s
    (which counts an FMA as two). In the flash kernels the softmax's elementwise ops and the
    checks' row sums and comparisons run between the tile GEMMs, issued by the same warps as the
    softmax's exp2: an FA2-style kernel (no warp specialisation, unlike FlashAttention-3) does
    not overlap them with the tensor cores, so the model adds their times to the GEMMs'. None:
    not known (the CPU profiles), and the flash path is not priced."""
    exp: float | None = None
    """exp2 a second on the special-function units (MUFU), the flash softmax's exponentials
    (Work.exps): 16 a clock an SM on sm_80 and sm_90, which on an H100 SXM is 3.9 T/s against
    989 TFLOP/s of bf16 matmul (FlashAttention-3, arXiv 2407.08608, section 3): at head dim 64
    the forward's exp2 take as long as its GEMMs. None: not known, as ``vector``."""

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
        ops and exponentials, in seconds."""
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
        }

    def _at(self, amount: float, rate: float | None, name: str) -> float:
        """``amount`` at ``rate``; refused where work needs a rate the profile does not have."""
        if not amount:
            return 0.0
        if rate is None:
            raise ValueError(
                f"DeviceProfile {self.name} has no {name} rate: the flash path is priced on GPU "
                "profiles (DEVICES)"
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


# --- baseline work --------------------------------------------------------------------------


def _gemm(m: float, k: float, n: float, batch: float = 1) -> Work:
    return Work(flops=2 * batch * m * k * n, ops=1)


def baseline_forward(shape: ModelShape) -> dict[str, Work]:
    """Forward work of one layer on one rank, by part; GEMMs as FLOPs, the rest as bytes. The
    softmax is apart (softmax_seconds)."""
    e = BYTES[shape.dtype]
    tokens = shape.seq * shape.micro_batch
    h, hn, tp = shape.hidden, shape.head_dim, shape.tp
    heads = shape.heads // tp
    qkv_width = (shape.heads + 2 * shape.groups) * hn // tp
    activation = tokens * h
    return {
        "qkv": _gemm(tokens, h, qkv_width) + Work(bytes=2 * tokens * qkv_width * e, ops=1),
        "scores": _gemm(shape.seq, hn, shape.seq, shape.micro_batch * heads),
        "rope": Work(bytes=4 * tokens * qkv_width * e, ops=3),  # rewrites q and k
        "context": _gemm(shape.seq, shape.seq, hn, shape.micro_batch * heads)
        + Work(bytes=2 * activation / tp * e, ops=2),  # permute + contiguous
        "proj": _gemm(tokens, h // tp, h),
        "mlp": _gemm(tokens, h, shape.ffn * (2 if shape.gated else 1) // tp)
        + _gemm(tokens, shape.ffn // tp, h)
        + Work(bytes=3 * tokens * shape.ffn / tp * e, ops=3),
        # two layer norms, two bias-dropout-adds, the TP all-reduces' copies
        "other": Work(bytes=14 * activation * e, ops=16),
    }


def softmax_seconds(shape: ModelShape, device: DeviceProfile, part: str) -> float:
    """Time of one layer's ``part`` (SOFTMAX_PARTS) of the scale-mask-softmax on one rank: at
    the device's measured cost per element of S where it has one; else Megatron's softmax by
    its bytes (it reads S and the mask and writes P; backward twice that), and the fused softmax no
    faster and its checks free (0)."""
    if part not in SOFTMAX_PARTS:
        raise ValueError(f"softmax part {part!r}; choose from {', '.join(SOFTMAX_PARTS)}")
    elements = shape.micro_batch * shape.heads // shape.tp * shape.seq**2
    if device.softmax is not None and part in device.softmax:
        return elements * device.softmax[part]
    if part not in ("forward", "backward"):
        return 0.0
    forward = device.time(Work(bytes=3 * elements * BYTES[shape.dtype], ops=3), shape.dtype)
    return 2 * forward if part == "backward" else forward


def forward_backward_time(shape: ModelShape, device: DeviceProfile, flash: bool = False) -> float:
    """The baseline step's forward and backward as counted, before ``device.baseline_scale``:
    the GEMMs' FLOPs (backward 2x), the memory traffic (backward 2x), the logits GEMM and the
    softmax both ways. ``flash``: with the flash attention's kernels (flash_baseline) in place
    of the unfused attention's FLASH_REPLACES and softmax."""
    parts = baseline_forward(shape)
    if flash:
        parts = {part: work for part, work in parts.items() if part not in FLASH_REPLACES}
    per_layer = sum(parts.values(), Work())
    tokens = shape.seq * shape.micro_batch
    logits = _gemm(tokens, shape.hidden, shape.vocab / shape.tp)
    forward = per_layer * shape.layers + logits
    backward = Work(flops=2 * forward.flops, bytes=2 * forward.bytes, ops=2 * forward.ops)
    if flash:
        core = device.time(sum(flash_baseline(shape).values(), Work()), shape.dtype)
    else:
        core = sum(softmax_seconds(shape, device, p) for p in ("forward", "backward"))
    return device.time(forward + backward, shape.dtype) + core * shape.layers


def step_time(shape: ModelShape, device: DeviceProfile, flash: bool = False) -> float:
    """Baseline training step: forward and backward (forward_backward_time, times the device's
    baseline_scale; ``flash``: with the flash attention), and an Adam update over this rank's
    parameters."""
    adam_bytes = shape.parameters() / shape.tp * ADAM_BYTES_PER_PARAMETER
    adam = adam_bytes / (device.optimizer_bandwidth or device.bandwidth)
    adam += 12 * 4 * shape.layers * device.launch
    return device.baseline_scale * forward_backward_time(shape, device, flash) + adam


def unfused_scores_bytes(shape: ModelShape) -> float:
    """One layer's S on one rank in the unfused attention, in bytes (P, kept for the backward,
    is as large again): what the flash attention never writes."""
    return shape.micro_batch * shape.heads // shape.tp * shape.seq**2 * BYTES[shape.dtype]


# --- the flash attention's baseline ---------------------------------------------------------

FLASH_REPLACES = tuple(s for s in FORWARD_SECTIONS if s in FLASH_SECTIONS)
"""The parts of the unfused attention's forward (baseline_forward) that the flash kernels
compute instead, with the softmax between them: the GEMMs both attentions check inside it."""


@dataclass(frozen=True)
class FlashKernel:
    """What one flash kernel does for each element of S it computes, as
    megatron_abft.flash.kernels writes it with the checks compiled out, before the compiler fuses
    anything (the per-row work, the running max and sum, is under 1% of it and left out)."""

    gemms: int
    """Tile GEMMs, 2 x head_dim FLOPs an element each (head_dim padded as the kernels pad it)."""
    elementwise: int
    """fp32 ops on the CUDA cores an element (Work.vector)."""
    accumulators: int
    """[rows, head_dim] fp32 accumulators each tile adds to: head_dim / (the side of the tiles
    the program loops over) ops an element each."""
    launch_ops: int
    """Tensor ops launched for the kernel, itself included."""
    exps: int = 1
    """exp2 an element: P, computed again by each backward kernel."""


FLASH_KERNELS = {
    "forward": FlashKernel(2, 8, 1, 1),
    "dkdv": FlashKernel(4, 9, 2, 2),
    "dq": FlashKernel(3, 8, 1, 1),
}
"""By tiles.KERNELS. The forward: S = Q K^T and P~ V; S scaled, masked (compare, and, where),
its row max, the shift, P's row sum and its cast; O rescaled as it accumulates. dK/dV: S^T,
dV += P^T dO, dP^T = V dO^T, dK += dS^T Q; the scale and LSE (an FMA), the mask (two ands, a
compare, where), P's cast, dS = P (dP - Delta) and its cast; dK and dV accumulate. dQ: S,
dP = dO V^T, dQ += dS K, as dK/dV without P's cast. The backward computes S and dP in both its
kernels: its GEMMs are 3.5x the forward's (7 tile GEMMs to 2), not FlashAttention-2's 2.5x.
Launches, from megatron_abft.flash.launch: each kernel, and before dK/dV the backward's
prologue (checksums.backward: Delta, and the checksum tiles when checks are due). Under
grouped-query attention the backward also sums each group's dK and dV (flash_group_sums)."""

GROUP_SUM_OPS = 4
"""Tensor ops of the backward's group sums under grouped-query attention: a sum over the group
and a cast into dK, and the same for dV (launch.backward)."""


def flash_group_sums(shape: ModelShape) -> Work:
    """The backward's group sums under grouped-query attention, one layer, one rank: the dK/dV
    kernel writes each query head's share of dK and dV in fp32, summed over each group in fp32
    and cast into dK and dV by torch ops. Nothing without groups."""
    f = _FlashShape.of(shape)
    if f.queries == f.keys:
        return Work()
    shares = f.queries * f.seq * f.head_dim * 4  # one of dK, dV a query head, fp32
    summed = f.keys * f.seq * f.head_dim * 4
    cast = f.keys * f.seq * f.head_dim * BYTES[f.dtype]
    return Work(ops=GROUP_SUM_OPS, bytes=2 * (shares + 2 * summed + cast))


_DTYPES = {DTYPE_NAMES[dtype]: dtype for dtype in GPU_DTYPES}
"""The dtypes the flash kernels take on a GPU, by name."""


@dataclass(frozen=True)
class _FlashShape:
    """One layer's flash attention on one rank, as the kernels see it."""

    queries: int
    """Q, O and dO matrices: micro-batch x the rank's query heads."""
    keys: int
    """K and V matrices: micro-batch x the rank's KV heads."""
    seq: int
    head_dim: int
    width: int
    """head_dim padded as the kernels pad it (tiles.padded_head_dim)."""
    dtype: str

    @classmethod
    def of(cls, shape: ModelShape) -> _FlashShape:
        if shape.dtype not in _DTYPES:
            raise ValueError(
                f"flash path: dtype {shape.dtype!r}; the kernels take {', '.join(_DTYPES)} on GPUs"
            )
        return cls(
            shape.micro_batch * shape.heads // shape.tp,
            shape.micro_batch * max(shape.groups // shape.tp, 1),
            shape.seq,
            shape.head_dim,
            padded_head_dim(shape.head_dim),
            shape.dtype,
        )

    def tiles(self, kernel: str) -> tuple[int, int]:
        """``kernel``'s (program side, loop side): a program's rows of S (its accumulators' and
        its checked tiles' rows), and the side of the tiles it loops over (launch.blocks); the
        loop side is also the rows of the tiles its checksum vectors are made for (PREPASS)."""
        b = blocks(kernel, self.width, _DTYPES[self.dtype])
        return (b.block_n, b.block_m) if kernel == "dkdv" else (b.block_m, b.block_n)

    def computed(self, kernel: str) -> float:
        """Elements of S ``kernel`` computes, causal (every model here is): a program's tiles up
        to the diagonal, whole."""
        tiles = -(-self.seq // self.tiles(kernel)[0])
        return self.queries * self.seq**2 * (tiles + 1) / (2 * tiles)


def flash_baseline(shape: ModelShape) -> dict[str, Work]:
    """Work of one layer's flash attention on one rank, by kernel (FLASH_KERNELS), with the
    checks compiled out (``flash_attention(..., sections=())``). Its bytes are O(seq x head_dim):
    each kernel reads Q, K, V (and dO, the LSE and Delta) and writes its outputs once, the tiles
    it reads again coming from L2; the backward's prologue reads O and dO once; under
    grouped-query attention dK/dV's group sums are the backward's (flash_group_sums)."""
    f = _FlashShape.of(shape)
    e = BYTES[f.dtype]
    q = f.queries * f.seq * f.head_dim * e  # Q, O, dO, dQ
    kv = f.keys * f.seq * f.head_dim * e  # K, V, dK, dV
    rows = f.queries * f.seq * 4  # the LSE, Delta
    delta = 2 * q + rows  # the prologue: O and dO read, Delta written, a value a row
    # dK and dV: each query head's share in fp32 under grouped-query attention
    grads = 2 * kv if f.queries == f.keys else 2 * f.queries * f.seq * f.head_dim * 4
    moved = {
        "forward": 2 * q + 2 * kv + rows,
        "dkdv": 2 * q + 2 * kv + grads + 2 * rows + delta,
        "dq": 3 * q + 2 * kv + 2 * rows,
    }
    out = {}
    for name, kernel in FLASH_KERNELS.items():
        elements = f.computed(name)
        loop = f.tiles(name)[1]
        out[name] = Work(
            flops=kernel.gemms * 2 * f.width * elements,
            bytes=moved[name],
            ops=kernel.launch_ops,
            vector=elements * (kernel.elementwise + kernel.accumulators * f.width / loop),
            exps=elements * kernel.exps,
        )
    out["dkdv"] += flash_group_sums(shape)
    return out


# --- protection work ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Checked:
    """One checked GEMM C = A @ B on a rank: ``batch`` matrices, A [m, k], B [k, n]; A (or B)
    shared by ``share_a`` (``share_b``) matrices, as K and V are under GQA."""

    batch: float
    m: float
    k: float
    n: float
    share_a: float = 1
    share_b: float = 1
    softmax_output: bool = False
    """C is the softmax's input (the scores): the fused path verifies it in that pass."""
    softmax_operand: bool = False
    """A is the softmax's output (the probabilities): the fused path sums it in that pass."""


def _checked_gemms(shape: ModelShape) -> dict[str, _Checked]:
    tokens = shape.seq * shape.micro_batch
    heads = shape.heads // shape.tp
    groups_per_rank = max(shape.groups // shape.tp, 1)
    rep = heads / groups_per_rank
    qkv_width = (shape.heads + 2 * shape.groups) * shape.head_dim / shape.tp
    return {
        "qkv": _Checked(1, tokens, shape.hidden, qkv_width),
        "scores": _Checked(
            shape.micro_batch * heads,
            shape.seq,
            shape.head_dim,
            shape.seq,
            share_b=rep,
            softmax_output=True,
        ),
        "context": _Checked(
            shape.micro_batch * heads,
            shape.seq,
            shape.seq,
            shape.head_dim,
            share_b=rep,
            softmax_operand=True,
        ),
        "proj": _Checked(1, tokens, shape.hidden / shape.tp, shape.hidden),
    }


def checks_of(impl: str) -> str:
    """The implementation whose checks ``impl``'s GEMMs take: ``apart``'s are ``kernels``', and
    so are the flash path's projections' (its attention checks itself, in the flash kernels)."""
    return "kernels" if impl in ("apart", "flash") else impl


def _side(g: _Checked, m, k, n, share_a, share_b, e: int, block: int, impl: str) -> Work:
    """Work of one side's checks: A's block sums, the checksum products with B, and (torch path)
    C's sums on this side; the kernels read C once for both sides (protection_forward)."""
    blocks = -(-m // block)
    a_elems = g.batch * m * k / share_a
    b_elems = g.batch * k * n / share_b
    c_elems = g.batch * m * n
    products = Work(flops=2 * g.batch * 3 * blocks * k * n)  # [e w] rows and the |.| row
    if impl != "torch":  # per side, half of: the larger operand once, the smaller twice
        products += Work(dots=g.batch * 3 * blocks * n)  # the kernels' (torch's: BLAS)
        larger, smaller = max(a_elems, b_elems), min(a_elems, b_elems)
        if impl == "fused" and g.softmax_operand:  # P's pass is the softmax's ("pass")
            larger = 0
            if b_elems >= a_elems:  # the products of P's rows with the smaller one's sums
                products = Work()
        return products + Work(bytes=(larger + 2 * smaller) * e / 2)
    # checksum.py: B to fp32, |B| (a copy), and the two products read both
    operand_b = Work(bytes=b_elems * (e + 4 + 8 + 4))
    # A to fp32, its block sums, abs and block sums of |A|
    encode = Work(bytes=a_elems * (e + 4 + 4 + 8 + 4))
    # sides.inspect_sides: C to fp32, weighted sums, abs, weighted sums of |C|
    verify = Work(bytes=c_elems * (e + 4 + 4 + 8 + 4))
    return products + operand_b + encode + verify


def protection_forward(
    shape: ModelShape,
    impl: str = "torch",
    ops: float | None = None,
    bias_ops: float | None = None,
) -> dict[str, Work]:
    """Extra forward work of each checked section, one layer, one rank, on a clean step, with
    ``ops`` ops a check (default CHECK_OPS[impl]), ``bias_ops`` more for a bias (default
    BIAS_OPS[impl]) and FUSED_CONTEXT_OPS more for the fused path's context. The unfused
    attention's (UNFUSED): the flash path's checks are flash_protection's and flash_shared's."""
    if impl not in UNFUSED:
        raise ValueError(
            f"impl {impl!r}; choose from {', '.join(UNFUSED)} (the flash path: flash_protection)"
        )
    impl = checks_of(impl)
    e, block = BYTES[shape.dtype], shape.block
    out = {}
    for section, g in _checked_gemms(shape).items():
        col = _side(g, g.m, g.k, g.n, g.share_a, g.share_b, e, block, impl)
        row = _side(g, g.n, g.k, g.m, g.share_b, g.share_a, e, block, impl)
        in_softmax = impl == "fused" and g.softmax_output  # S verified as the softmax reads it
        # the torch path's verify passes are counted per side (_side)
        verify = Work(bytes=0 if impl == "torch" or in_softmax else g.batch * g.m * g.n * e)
        launched = CHECK_OPS[impl] if ops is None else ops
        if section == "qkv" and shape.bias:  # the only checked GEMM with a bias
            launched += BIAS_OPS[impl] if bias_ops is None else bias_ops
        if impl == "fused" and g.softmax_operand:  # the context's references from P's pass
            launched += FUSED_CONTEXT_OPS
        out[section] = col + row + verify + Work(ops=launched)
    return out


# --- the flash attention's checks -----------------------------------------------------------

_SCORES, _CONTEXT, _BWD_SCORES, _GRAD_PROBS, _GRAD_V, _GRAD_K, _GRAD_Q = FLASH_SECTIONS
# in config's order, which the kernels' section codes follow


@dataclass(frozen=True)
class FlashCheck:
    """One checked tile GEMM ``C = A B`` of a flash kernel, by how the kernel checks it
    (megatron_abft.flash.kernels): each program compares its rows once, after its loop."""

    section: str
    kernel: str
    kind: str
    """``summed``: C is a tile of S, S^T, dP or dP^T; the loop adds up C's row sums (an add an
    element) and the program compares them with one 16-wide MMA of its head_dim-wide operand
    tile against the summed checksums of the tiles it met. ``accumulated``: C is head_dim wide
    and accumulates (the context, dV, dK, dQ); a 16-wide MMA of each tile's P~, P^T, dS^T or dS
    against the B tile's checksums accumulates the reference (16 / head_dim of the GEMM), and
    the program compares it with its output's row sums. ``identity``: the dQ kernel checks S and
    dP through sum P = 1 and sum dS = 0 (flash_shared's identities), a comparison a row."""
    mass: float = 0
    """CUDA-core ops an element of S for the bound's mass beyond the row's own norms: dQ's
    ``|dS|``, two 16-bit values an AND."""
    mass_mma: bool = False
    """The mass comes from a second 16-wide MMA beside the reference (dQ's, of ``|dS|``)."""
    rescaled: bool = False
    """The reference is rescaled as the output is (the forward's online softmax): 16 ops a row
    a tile."""


FLASH_CHECKS = (
    FlashCheck(_SCORES, "forward", "summed"),
    FlashCheck(_CONTEXT, "forward", "accumulated", rescaled=True),
    FlashCheck(_BWD_SCORES, "dkdv", "summed"),
    FlashCheck(_GRAD_V, "dkdv", "accumulated"),
    FlashCheck(_GRAD_PROBS, "dkdv", "summed"),
    FlashCheck(_GRAD_K, "dkdv", "accumulated"),
    FlashCheck(_BWD_SCORES, "dq", "identity"),
    FlashCheck(_GRAD_PROBS, "dq", "identity"),
    FlashCheck(_GRAD_Q, "dq", "accumulated", mass=0.5, mass_mma=True),
)
"""Every tile check of the flash kernels, in the order they run (megatron_abft.flash.kernels):
S and dP are computed, and checked, in both backward kernels. dK's masses come with dV's
reference, from the same MMA of P^T."""
CHECK_ROW_OPS = 33
"""CUDA-core ops of one program's comparison for each of its rows, as the kernels write them:
the reference's parts summed (16) and scaled (1), the mass and the bound (2), and _fold's
comparison, fault kind and state (14)."""
IDENTITY_OPS = 2
"""CUDA-core ops an element of S the dQ kernel spends on its row identities when bwd_scores or
grad_probs is due: sum P and sum dS (their bounds take |dP| from the rows' norms, per row)."""
RETRY_OPS = 3
"""Launches of the kernels' second pass (launch._twice), one a kernel that checks anything:
each program reads its flag and returns, unless its first pass flagged."""


@dataclass(frozen=True)
class Prepass:
    """The checksum tiles of one operand, made before a kernel (megatron_abft.flash.checksums),
    and the launches that make them (0: in another operand's launch)."""

    query: bool
    """Its operands are query-sized (Q, dO), else KV-sized (K, V)."""
    reads: int
    """Operands it reads that the baseline does not."""
    rows: int = 0
    """Row-sum tiles it writes: ``[block, 16]`` parts of the input dtype a tile."""
    columns: int = 0
    """Column-sum vectors: ``[head_dim]`` in fp32 a tile (written, then read by the running-sum
    launch, which writes them ``[head_dim, 16]`` as parts of the input dtype, all the vectors
    of a tile in one)."""
    stats: int = 3
    """fp32 values a tile of its stats (scales, masses)."""
    launches: int = 1


PREPASS = {
    "forward": (Prepass(False, 1, columns=1, launches=2), Prepass(False, 1, rows=1, launches=0)),
    "dkdv": (Prepass(True, 1, rows=1, columns=2, stats=8),),
    "dq": (Prepass(False, 1, rows=1), Prepass(False, 1, rows=1, launches=0)),
}
"""The checksum tiles launch.py makes before each kernel when all its sections are due: the
forward's of K (the prefix sums of its columns: checksums.key_value_sums and its running sums)
and of V (rows) in the same launch, tiled by its block_n; dK/dV's from the prologue that
computes Delta anyway (checksums.backward: one tile of dO's and Q's rows, their suffix column
sums, from one more read of Q and one launch of running sums), tiled by its block_m; dQ's of K
and V (rows), one launch, by its block_n."""
FOUND_OPS = 1
"""Launches of one call's findings buffer (launch.Findings.empty: one zero fill), made by each of
the forward's and the backward's ops when they check anything."""
RECORD_OPS = 1
"""GPU launches of one ledger update (megatron_abft.flash.ledger.record: one Triton launch after
each of the forward's and the backward's ops when they checked anything), counted on the code by
tests/tuning/test_scaling.py."""


def _prepass(f: _FlashShape, p: Prepass, block: int) -> Work:
    """One of PREPASS's launches for ``block``-row tiles: the operands it reads, and the tiles
    and stats it writes (the column sums twice more in fp32, through the running sums)."""
    e = BYTES[f.dtype]
    matrices = f.queries if p.query else f.keys
    tiles = -(-f.seq // block)
    tile = p.rows * block * WIDTH * e + p.stats * 4
    if p.columns:
        tile += f.width * WIDTH * e + 2 * p.columns * f.width * 4
    read = p.reads * matrices * f.seq * f.head_dim * e
    return Work(bytes=read + matrices * tiles * tile, ops=p.launches)


def flash_protection(shape: ModelShape) -> dict[str, Work]:
    """The own work of each of FLASH_SECTIONS in the flash kernels, one layer, one rank, a clean
    step, by its checks' kinds (FlashCheck): the reference MMAs (tensor-core FLOPs), the row
    sums and masses (CUDA-core ops an element of S) and a program's comparisons (CHECK_ROW_OPS
    a row, with the output's row sums for an accumulated check: each row is in one program of
    each kernel, a query row forward and in dQ, a key row of a query head in dK/dV). What every
    launch does once anything is due is flash_shared's. A clean program computes its block
    once: nothing is recomputed."""
    f = _FlashShape.of(shape)
    rows = f.queries * f.seq
    out = dict.fromkeys(FLASH_SECTIONS, Work())
    for check in FLASH_CHECKS:
        elements = f.computed(check.kernel)
        loop = f.tiles(check.kernel)[1]
        mass = check.mass + WIDTH / loop * check.rescaled
        if check.kind == "summed":  # one MMA [head_dim, 16] a row
            work = Work(flops=rows * 2 * WIDTH * f.width, vector=elements + rows * CHECK_ROW_OPS)
        elif check.kind == "accumulated":  # an MMA [loop, 16] a row a tile (two: dQ)
            work = Work(
                flops=elements * 2 * WIDTH * (1 + check.mass_mma),
                vector=elements * mass + rows * (f.width + CHECK_ROW_OPS),
            )
        else:
            work = Work(vector=rows * CHECK_ROW_OPS)
        out[check.section] += work
    return out


def flash_shared(shape: ModelShape) -> dict[str, Work]:
    """What the flash path runs, one layer, one rank, on any step that checks any of its
    sections, whichever they are: a launch with anything due compiles the checks in and makes
    all its checksum tiles, and every launch of the step has what is due (one ``due`` mask).
    By part: ``prepass``, the checksum tiles (PREPASS); ``odo``, the backward's rounding of
    Delta (``sum |O| |dO|`` a row, which the prologue writes beside Delta); ``identities``, the
    dQ kernel's row identities (IDENTITY_OPS); ``retry``, each kernel's second launch
    (RETRY_OPS); ``ledger``, the findings buffers (FOUND_OPS) and the ledger's updates
    (RECORD_OPS) of the forward and the backward. The kernels' reads of the tiles, a tile's at a
    time and mostly from L2, are left out."""
    f = _FlashShape.of(shape)
    prepass = Work()
    for kernel, launches in PREPASS.items():
        for p in launches:
            prepass += _prepass(f, p, f.tiles(kernel)[1])
    return {
        "prepass": prepass,
        "odo": Work(bytes=f.queries * f.seq * 4),
        "identities": Work(vector=f.computed("dq") * IDENTITY_OPS),
        "retry": Work(ops=RETRY_OPS),
        # the findings buffers (codes, rows, columns of each section and matrix), zero-filled
        "ledger": Work(
            ops=2 * (FOUND_OPS + RECORD_OPS), bytes=2 * 3 * len(FLASH_SECTIONS) * f.queries * 4
        ),
    }


@dataclass(frozen=True)
class Prediction:
    """Predicted overheads as fractions of the unprotected time: the unfused attention's against
    the unprotected step with the unfused attention, the flash path's against the unprotected
    step with the flash attention (its kernels with the checks compiled out)."""

    shape: ModelShape
    device: str
    impl: str
    sections: dict[str, float] = field(default_factory=dict)
    """Each section alone, every step: extra time over the baseline step (every section the
    implementation checks: FORWARD_SECTIONS unfused, SECTIONS flash)."""
    attention: float = 0.0
    """All checked sections over the attention block's time: its forward unfused (the checks
    are forward work), its forward and backward on the flash path (they are in both)."""
    step: float = 0.0
    """All checked sections (with their intervals) over the baseline step time."""
    step_seconds: float = 0.0
    shared: float = 0.0
    """The flash path: what it runs on any step that checks any of its sections (flash_shared),
    over the baseline step; part of each of its sections' figures, once in ``step``."""


def predict(
    shape: ModelShape,
    device: DeviceProfile,
    impl: str = "torch",
    sections: tuple[str, ...] | None = None,
    intervals: dict[str, int] | None = None,
) -> Prediction:
    """Overhead of protecting ``sections`` (checked every ``intervals[s]`` steps; default every
    section ``impl`` checks) for ``shape``."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl {impl!r}; choose from {', '.join(IMPLEMENTATIONS)}")
    checked = SECTIONS if impl == "flash" else FORWARD_SECTIONS
    sections = checked if sections is None else sections
    if unknown := set(sections) - set(checked):
        raise ValueError(f"sections {sorted(unknown)}: impl {impl!r} checks {', '.join(checked)}")
    intervals = intervals or {}
    if impl == "flash":
        return _predict_flash(shape, device, sections, intervals)
    checks = checks_of(impl)
    extra = {
        s: device.check_time(w, shape.dtype) * shape.layers
        for s, w in protection_forward(
            shape, impl, device.ops_per_check(checks), device.ops_per_bias(checks)
        ).items()
    }
    # the fused softmax replaces Megatron's softmax on the steps that check the scores or the
    # context (apart: the scores, as P's pass is not made)
    swap = dict.fromkeys(("forward", "backward"), 0.0)
    swapping = ("scores",) if impl == "apart" else FUSED_SECTIONS
    if impl == "fused":
        extra["scores"] += softmax_seconds(shape, device, "screen") * shape.layers
        extra["context"] += softmax_seconds(shape, device, "pass") * shape.layers
    if impl in ("fused", "apart"):
        for way in swap:
            swap[way] = softmax_seconds(shape, device, f"fused_softmax_{way}") * shape.layers
    fused_share = _share_of_steps([intervals.get(s, 1) for s in sections if s in swapping])
    base = step_time(shape, device)
    forward = baseline_forward(shape)
    attention = device.time(sum((forward[p] for p in ATTENTION_PARTS), Work()), shape.dtype)
    attention += softmax_seconds(shape, device, "forward")
    attention *= device.baseline_scale
    swapped = sum(swap.values())
    checked = sum(extra[s] / intervals.get(s, 1) for s in sections) + swapped * fused_share
    attention_swap = swap["forward"] if fused_share else 0.0
    return Prediction(
        shape=shape,
        device=device.name,
        impl=impl,
        sections={s: (extra[s] + swapped * (s in swapping)) / base for s in FORWARD_SECTIONS},
        attention=(sum(extra[s] for s in sections) + attention_swap) / shape.layers / attention,
        step=checked / base,
        step_seconds=base,
    )


def _predict_flash(
    shape: ModelShape, device: DeviceProfile, sections: tuple[str, ...], intervals: dict[str, int]
) -> Prediction:
    """predict for the flash path: qkv and proj as ``kernels``, the flash sections' own work
    (flash_protection) on the steps that check each, flash_shared on the steps that check any."""
    kernels = protection_forward(
        shape, "kernels", device.ops_per_check("kernels"), device.ops_per_bias("kernels")
    )
    own = {s: kernels[s] for s in FORWARD_SECTIONS if s not in FLASH_SECTIONS}
    own |= flash_protection(shape)
    extra = {s: device.check_time(own[s], shape.dtype) * shape.layers for s in SECTIONS}
    shared_work = sum(flash_shared(shape).values(), Work())
    shared = device.check_time(shared_work, shape.dtype) * shape.layers
    flash_due = [intervals.get(s, 1) for s in sections if s in FLASH_SECTIONS]
    base = step_time(shape, device, flash=True)
    forward = baseline_forward(shape)
    around = sum((forward[p] for p in ATTENTION_PARTS if p not in FLASH_REPLACES), Work())
    core = sum(flash_baseline(shape).values(), Work())
    attention = device.time(around * 3 + core, shape.dtype)  # their backward 2x their forward
    attention *= device.baseline_scale
    checked = sum(extra[s] / intervals.get(s, 1) for s in sections)
    return Prediction(
        shape=shape,
        device=device.name,
        impl="flash",
        sections={s: (extra[s] + shared * (s in FLASH_SECTIONS)) / base for s in SECTIONS},
        attention=(sum(extra[s] for s in sections) + shared * bool(flash_due))
        / shape.layers
        / attention,
        step=(checked + shared * _share_of_steps(flash_due)) / base,
        step_seconds=base,
        shared=shared / base,
    )


FUSED_SECTIONS = ("scores", "context")
"""The sections whose checks run the fused softmax in place of Megatron's softmax."""
ATTENTION_PARTS = ("qkv", "scores", "rope", "context", "proj")
"""The parts of baseline_forward in the attention block."""


def _share_of_steps(intervals: list[int]) -> float:
    """The share of steps on which at least one of the checks with these ``intervals`` is due
    (a check every n steps is due on the steps that n divides): inclusion-exclusion over the
    steps that several of them divide."""
    return sum(
        (-1) ** (len(subset) + 1) / math.lcm(*subset)
        for r in range(1, len(intervals) + 1)
        for subset in combinations(intervals, r)
    )


# --- model shapes users train -----------------------------------------------------------------


def _gpt3(name, layers, hidden, heads, tp):
    return ModelShape(name, layers, hidden, heads, 4 * hidden, 50257, tp=tp)


def _llama(name, layers, hidden, heads, groups, ffn, vocab, tp):
    return ModelShape(
        name,
        layers,
        hidden,
        heads,
        ffn,
        vocab,
        tp=tp,
        kv_groups=groups,
        gated=True,
        tied_embeddings=False,
        bias=False,
    )


CATALOGUE: tuple[ModelShape, ...] = (
    _gpt3("GPT-3 125M", 12, 768, 12, 1),
    _gpt3("GPT-3 350M", 24, 1024, 16, 1),
    _gpt3("GPT-3 760M", 24, 1536, 16, 1),
    _gpt3("GPT-3 1.3B", 24, 2048, 16, 1),
    _gpt3("GPT-3 2.7B", 32, 2560, 32, 2),
    _gpt3("GPT-3 6.7B", 32, 4096, 32, 4),
    _gpt3("GPT-3 13B", 40, 5120, 40, 8),
    _gpt3("GPT-3 175B", 96, 12288, 96, 8),
    _llama("Llama-2 7B", 32, 4096, 32, None, 11008, 32000, 2),
    _llama("Llama-2 13B", 40, 5120, 40, None, 13824, 32000, 4),
    _llama("Llama-2 70B", 80, 8192, 64, 8, 28672, 32000, 8),
    _llama("Llama-3 8B", 32, 4096, 32, 8, 14336, 128256, 2),
    _llama("Llama-3 70B", 80, 8192, 64, 8, 28672, 128256, 8),
)
"""GPT-3 (Brown et al. 2020, table 2.1) and Llama 2/3 shapes at their usual tensor parallelism.
Sequence length and micro-batch are set per use with ``dataclasses.replace``."""


def at_sequence(shape: ModelShape, seq: int) -> ModelShape:
    return replace(shape, seq=seq)
