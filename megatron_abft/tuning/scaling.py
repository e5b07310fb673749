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
  the kernels' second launches and the findings buffers (all counted in
  megatron_abft.tuning.flash_work). qkv and proj are checked as by ``kernels``.

Every check also costs a number of small ops, each at the device's op latency
(megatron_abft.tuning.devices): on a CPU the top-level tensor ops of a clean check (CHECK_OPS,
counted on the code by tests/tuning/test_scaling.py; eager dispatch and the Python around it,
which tools/bench_overhead.py measures on the check itself), on a GPU the kernels a clean
sync-free check launches (CHECK_KERNELS). On a CPU each dot product of the kernels' checksum
products (an operand's row against one checksum vector) also costs a fixed time beyond its
multiply-adds (DeviceProfile.check_dot, measured by the benchmark): for an operand head_dim
wide, as Q, K and V are, that cost is most of the products'.

The unfused attention's backward pass is not protected: its protection costs forward work only,
while the baseline step is forward + backward (2x the GEMM FLOPs) + optimizer. The flash path
checks the attention's backward GEMMs too. docs/scaling.md validates the model
against tools/bench_overhead.py and reports predictions for common model shapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import combinations

from megatron_abft.config import FLASH_SECTIONS, FORWARD_SECTIONS, SECTIONS
from megatron_abft.tuning.devices import BIAS_OPS, CHECK_OPS, SOFTMAX_PARTS, DeviceProfile
from megatron_abft.tuning.flash_work import (
    FLASH_REPLACES,
    flash_baseline,
    flash_protection,
    flash_shared,
)
from megatron_abft.tuning.shapes import BYTES, ModelShape, Work

UNFUSED = ("torch", "kernels", "apart", "fused")
"""How the unfused attention's checks run: the PyTorch path; today's code with the compiled
kernels (one read of C for both sides with the comparisons, one of the larger operand and two of
the smaller); the same checks with the fused softmax as the softmax (a CPU's); and the fused path
(the softmax pass verifies S and sums P, so those two reads go)."""
IMPLEMENTATIONS = (*UNFUSED, "flash")
"""UNFUSED, and the flash attention's checks inside its kernels (qkv and proj as ``kernels``)."""
MMA_PRODUCTS_MIN_ELEMENTS = 1 << 22
"""On a GPU, a 2-D bf16 GEMM whose larger operand has this many elements takes its checks'
products on the tensor cores (csrc/bindings/abft_mma_products.cpp; kMmaProductsMinElements):
each checksum vector split into three bf16 parts, each operand and its absolute values times
all of them by cuBLAS."""
MMA_PRODUCTS_OPS = 5
"""The launches of mma_products for one operand, counted from the code: the vectors' split into
three parts (mma_parts), the operand's absolute values, two GEMMs and the sums of their parts
(mma_sums). Both operands' replace the one launch of the products kernel."""
FUSED_CONTEXT_OPS = 1
"""What the context's check in the fused path launches beyond CHECK_KERNELS["fused"] (the
scores'), counted from the code: its references come from P's pass by pair_vectors and
encode_pair_from (a launch each, as many as encode_pair's two), and it verifies C by
verify_correct_tally (two launches, where the scores' correction is one): 4, as many as a check
of today's kernels. A CPU is charged the same one op more (its two ops where encode_pair is one;
the views of P's pass that make the row side are ops there too, of next to no cost)."""
ADAM_BYTES_PER_PARAMETER = 16 * 4
"""Traffic of one Adam update per parameter, op by op as torch's foreach Adam does it."""


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


def _side(
    g: _Checked, m, k, n, share_a, share_b, e: int, block: int, impl: str, mma: bool = False
) -> Work:
    """Work of one side's checks: A's block sums, the checksum products with B, and (torch path)
    C's sums on this side; the kernels read C once for both sides (protection_forward). ``mma``:
    the products on the tensor cores (MMA_PRODUCTS_MIN_ELEMENTS)."""
    blocks = -(-m // block)
    a_elems = g.batch * m * k / share_a
    b_elems = g.batch * k * n / share_b
    c_elems = g.batch * m * n
    if mma:  # half of both operands' block sums (a checksum kernel); then, by cuBLAS, B
        # times three parts of each block's two sums and |B| (written once) times those of its
        # size (9 blocks columns), their fp32 products written and summed
        return Work(
            flops=g.batch * 2 * n * k * 9 * blocks,
            bytes=(a_elems + b_elems) * e / 2,
            stream=4 * b_elems * e + 2 * 4 * g.batch * n * 9 * blocks,
            launches=MMA_PRODUCTS_OPS,
        )
    # [e w] rows and the |.| row: fp32 multiply-adds, on the CUDA cores (torch's fp32 matmul too)
    products = Work(vector=g.batch * 3 * blocks * k * n)
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
    gpu: bool = False,
) -> dict[str, Work]:
    """Extra forward work of each checked section, one layer, one rank, on a clean step, with
    ``ops`` ops a check (default CHECK_OPS[impl]), ``bias_ops`` more for a bias (default
    BIAS_OPS[impl]) and FUSED_CONTEXT_OPS more for the fused path's context. The unfused
    attention's (UNFUSED): the flash path's checks are flash_protection's and flash_shared's.
    ``gpu``: as a GPU runs the kernels' checks, whose large 2-D bf16 GEMMs take their products
    on the tensor cores (MMA_PRODUCTS_MIN_ELEMENTS)."""
    if impl not in UNFUSED:
        raise ValueError(
            f"impl {impl!r}; choose from {', '.join(UNFUSED)} (the flash path: flash_protection)"
        )
    impl = checks_of(impl)
    e, block = BYTES[shape.dtype], shape.block
    out = {}
    for section, g in _checked_gemms(shape).items():
        mma = (
            gpu
            and impl != "torch"
            and shape.dtype == "bf16"
            and g.batch == 1
            and max(g.m, g.n) * g.k >= MMA_PRODUCTS_MIN_ELEMENTS
        )
        col = _side(g, g.m, g.k, g.n, g.share_a, g.share_b, e, block, impl, mma)
        row = _side(g, g.n, g.k, g.m, g.share_b, g.share_a, e, block, impl, mma)
        in_softmax = impl == "fused" and g.softmax_output  # S verified as the softmax reads it
        # the torch path's verify passes are counted per side (_side)
        verify = Work(bytes=0 if impl == "torch" or in_softmax else g.batch * g.m * g.n * e)
        launched = CHECK_OPS[impl] if ops is None else ops
        if mma:  # the sides' ops in place of the products kernel's launch
            launched -= 1
        if section == "qkv" and shape.bias:  # the only checked GEMM with a bias
            launched += BIAS_OPS[impl] if bias_ops is None else bias_ops
        if impl == "fused" and g.softmax_operand:  # the context's references from P's pass
            launched += FUSED_CONTEXT_OPS
        out[section] = col + row + verify + Work(ops=launched)
    return out


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
            shape, impl, device.ops_per_check(checks), device.ops_per_bias(checks), device.gpu
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
        shape,
        "kernels",
        device.ops_per_check("kernels"),
        device.ops_per_bias("kernels"),
        device.gpu,
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


PROJECTIONS = ("qkv", "proj")
"""The checked GEMMs of the attention block that are linear layers, checked alike on every path
(``kernels``)."""


@dataclass(frozen=True)
class ProjectionCost:
    """One projection's GEMM, forward, on one rank, against its clean check (seconds)."""

    gemm: float
    """The GEMM's FLOPs at the profile's matmul rate."""
    check: float
    """Its clean check as the kernels run it (encode_pair, add_bias, the screen of the output)."""
    floor: float
    """The least any check that runs after the GEMM costs: one read of the output (to sum it),
    at the bandwidth. Over ``gemm`` that is about ``(matmul rate / bandwidth) / k``, ``k`` the
    GEMM's inner dimension, whatever the kernels do; only sums taken from the GEMM's own
    accumulators, in its epilogue, read nothing again."""


def projection_costs(shape: ModelShape, device: DeviceProfile) -> dict[str, ProjectionCost]:
    """The qkv and output projections' GEMMs against their checks, for ``shape`` on ``device``:
    where a projection's check can go and where it is now."""
    checks = protection_forward(
        shape,
        "kernels",
        device.ops_per_check("kernels"),
        device.ops_per_bias("kernels"),
        device.gpu,
    )
    gemms = _checked_gemms(shape)
    e = BYTES[shape.dtype]
    costs = {}
    for section in PROJECTIONS:
        g = gemms[section]
        costs[section] = ProjectionCost(
            gemm=_gemm(g.m, g.k, g.n, g.batch).flops / device.matmul[shape.dtype],
            check=device.check_time(checks[section], shape.dtype),
            floor=g.batch * g.m * g.n * e / device.bandwidth,
        )
    return costs


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
