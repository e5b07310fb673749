"""The flash path's work in the overhead model (megatron_abft.tuning.flash_work), held to what
the flash launches run and move, and its predictions."""

from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megatron_abft.config import BACKWARD_SECTIONS, FLASH_SECTIONS, FORWARD_SECTIONS, SECTIONS
from megatron_abft.dev import aot
from megatron_abft.tuning.devices import DEVICES, DeviceProfile
from megatron_abft.tuning.flash_work import (
    CHECK_ROW_OPS,
    FLASH_CHECKS,
    FLASH_KERNELS,
    FLASH_REPLACES,
    FOUND_OPS,
    GROUP_SUM_OPS,
    IDENTITY_OPS,
    PREPASS,
    RETRY_OPS,
    SCALED,
    SPLIT,
    flash_baseline,
    flash_group_sums,
    flash_protection,
    flash_shared,
)
from megatron_abft.tuning.scaling import (
    baseline_forward,
    predict,
    protection_forward,
    softmax_seconds,
    step_time,
    unfused_scores_bytes,
)
from megatron_abft.tuning.shapes import BYTES, CATALOGUE, ModelShape, Work

SHAPES = {shape.name: shape for shape in CATALOGUE}


FLASH_SHAPE = ModelShape("flash", 2, 192, 4, 768, 1000, seq=96, micro_batch=2, kv_groups=2)
"""A GQA layer whose head dim (48) the kernels pad (to 64) and whose sequence fills none of the
kernels' tiles."""


class _Launches(TorchDispatchMode):
    """What the torch ops run in the mode would launch on a GPU, and the bytes they move. Not
    launched: views, uninitialised tensors, host reads (_local_scalar_dense) and what feeds them
    (one_hot's range checks, full min and max, which it makes on CPU tensors only), and Python
    scalars wrapped as tensors. An op reads its tensor arguments (copy_ its source only, a
    factory none) and writes its outputs."""

    SILENT = ("empty", "empty_like", "new_empty", "_local_scalar_dense", "scalar_tensor")
    FACTORIES = ("zeros", "zeros_like", "ones_like", "full", "full_like", "arange")

    def __init__(self):
        super().__init__()
        self.ops, self.bytes = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        one_hot_check = func in (torch.ops.aten.min.default, torch.ops.aten.max.default)
        if func.is_view or name in self.SILENT or one_hot_check:
            return out
        read = () if name in self.FACTORIES else args[1:2] if name == "copy_" else (args, kwargs)
        tensors = [t for t in tree_leaves((read, out)) if isinstance(t, torch.Tensor)]
        self.ops += 1
        self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        return out


def _flash_launches(shape: ModelShape, due: int) -> dict[str, tuple[int, int]]:
    """Ops launched (the Triton kernels among them) and bytes the torch ops move, for one
    layer's flash attention, forward and backward, TP 1, with the ``due`` sections' bits, as
    attention.py's custom ops run them (their findings buffer, the launches, the ledger's
    update) with the kernels' launches recorded, not run."""
    from megatron_abft.flash.attention import _backward, _forward
    from megatron_abft.flash.ledger import FlashLedger

    b, n, d = shape.micro_batch, shape.seq, shape.head_dim
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[shape.dtype]
    q, do = (torch.randn(b, shape.heads, n, d).to(dtype) for _ in range(2))
    k, v = (torch.randn(b, shape.groups, n, d).to(dtype) for _ in range(2))
    ledger = FlashLedger.on(q.device).tensors
    options = dict(causal=True, scale=d**-0.5, due=due, tol=2.0**-18, near_inf=1e10)
    counted = {}
    kernels: list = []
    with aot.recording(kernels), _Launches() as mode:
        o, lse = _forward(q, k, v, *ledger, None, **options)
    counted["forward"] = (mode.ops + len(kernels), mode.bytes)
    kernels.clear()
    with aot.recording(kernels), _Launches() as mode:
        _backward(do, q, k, v, o, lse, *ledger, None, **options)
    counted["backward"] = (mode.ops + len(kernels), mode.bytes)
    return counted


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_the_flash_launches_run_the_ops_and_move_the_bytes_the_model_counts(dtype):
    """FLASH_KERNELS' launches, flash_group_sums and flash_shared's prepass, second launches and
    findings follow the code: counted on it (kernels stubbed), with the checks compiled out and
    in. Every byte but the group sums' moves in Triton kernels, none in torch ops; the
    prepass's the model counts from the tiles it writes."""
    from megatron_abft.flash import checksums

    shape = replace(FLASH_SHAPE, dtype=dtype)
    off = _flash_launches(shape, 0)
    on = _flash_launches(shape, 2 ** len(FLASH_SECTIONS) - 1)
    group = flash_group_sums(shape)
    assert group.ops == GROUP_SUM_OPS  # FLASH_SHAPE's two query heads a group
    assert off["forward"] == (FLASH_KERNELS["forward"].launch_ops, 0)
    backward = FLASH_KERNELS["dkdv"].launch_ops + FLASH_KERNELS["dq"].launch_ops
    assert off["backward"] == (backward + group.ops, group.bytes)
    # with the checks, the findings buffers: codes, rows, columns of each section and matrix,
    # the count of the programs done and three counters a head (the checksum launches')
    buffer = ((3 * len(FLASH_SECTIONS) + 3) * shape.micro_batch * shape.heads + 1) * 4
    assert on["forward"][1] == buffer
    assert on["backward"][1] == buffer + group.bytes
    outputs = shape.micro_batch * shape.heads * shape.seq * shape.head_dim
    e = BYTES[dtype]
    rows = shape.micro_batch * shape.heads * shape.seq * 4
    delta = 2 * outputs * e + rows  # the prologue reads O and dO, writes a value a row
    # Q, dO; K, V; each query head's dK and dV in fp32; LSE, Delta
    kernel_io = 2 * outputs * e + 2 * outputs // 2 * e + 2 * outputs * 4 + 2 * rows
    assert flash_baseline(shape)["dkdv"].bytes == pytest.approx(kernel_io + delta + group.bytes)
    shared = flash_shared(shape)
    findings = 2 * FOUND_OPS  # the forward's and the backward's buffers
    extra = shared["prepass"].ops + shared["retry"].ops + findings
    assert sum(on[w][0] - off[w][0] for w in on) == extra
    split = sum(p.launches for p in SPLIT.values()) if dtype in SCALED else 0
    assert shared["prepass"].ops == sum(p.launches for c in PREPASS.values() for p in c) + split
    assert shared["retry"].ops == RETRY_OPS == len(FLASH_KERNELS)
    assert shared["odo"].bytes == rows
    assert shared["ledger"].bytes == 2 * buffer
    # the prepass's bytes: each operand read once more, the tiles it writes, and the column
    # sums in fp32 (written, read by the running sums)
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    b, n, d, width = shape.micro_batch, shape.seq, shape.head_dim, 64
    query, o, do = (torch.randn(b, shape.heads, n, d).to(torch_dtype) for _ in range(3))
    key = torch.randn(b, shape.groups, n, d).to(torch_dtype)

    def size(*tensors):
        return sum(t.numel() * t.element_size() for t in tensors)

    def raw(sums, values):  # fp16's row sums in fp32, written and read again (SPLIT)
        return 2 * sums.parts.shape[0] * sums.parts.shape[1] * values * 4 if dtype in SCALED else 0

    block = launch_tiles("forward", torch_dtype)
    columns, _, rows_v = checksums.key_value_sums(key, key, block, width, True, False, True)
    fp32_sums = columns.stats.shape[1] * width * 4 * b * shape.groups
    written = (
        2 * size(key)
        + size(columns.parts, columns.stats, rows_v.parts, rows_v.stats)
        + 2 * fp32_sums
        + raw(rows_v, 2)
    )
    block = launch_tiles("dq", torch_dtype)
    _, rows_k, rows_v = checksums.key_value_sums(key, key, block, width, False, True, True)
    written += size(key, key, rows_k.parts, rows_k.stats, rows_v.parts, rows_v.stats)
    written += raw(rows_k, 2) + raw(rows_v, 2)
    block = launch_tiles("dkdv", torch_dtype)
    made = checksums.backward(o, do, query, block, width, False, True, True, True)
    fp32_sums = made.stats.shape[1] * 2 * width * 4 * b * shape.heads
    tiles = (made.rows, made.columns, made.stats)
    written += size(query, *tiles) + 2 * fp32_sums
    if dtype in SCALED:  # dO's and Q's rows in fp32, and each tile's peaks of them
        rows = made.rows.shape[0] * made.rows.shape[1] // 2  # two tiles a query block
        written += 2 * rows * checksums.RAW_VALUES * 4
        written += made.stats[..., :2].numel() * 4
    assert (torch_dtype in checksums.HEADROOM) == (dtype in SCALED)
    assert shared["prepass"].bytes == pytest.approx(written)


def launch_tiles(kernel: str, dtype) -> int:
    """The rows of the tiles ``kernel``'s checksum tiles are made for (launch.blocks)."""
    from megatron_abft.flash.tiles import blocks

    tiles = blocks(kernel, 64, dtype)
    return tiles.block_m if kernel == "dkdv" else tiles.block_n


def test_the_ledger_takes_the_findings_buffers_launches_alone():
    """FOUND_OPS follows launch.Findings.empty (one zero fill); the ledger's update is no launch
    of its own: the last program of a call's last launch makes it (kernels._record), so that
    the flash launches' count above, taken on attention.py's ops, holds the findings buffers,
    the prepass and the second launches, nothing more."""
    from megatron_abft.flash import launch

    with _Launches() as mode:
        launch.Findings.empty(6, torch.device("cpu"))
    assert mode.ops == FOUND_OPS
    # forward and backward
    assert flash_shared(FLASH_SHAPE)["ledger"].ops == 2 * FOUND_OPS


def _computed(seq: int, side: int, matrices: int) -> float:
    """Elements of S a causal kernel computes whose programs take ``side`` rows: the tiles up to
    the diagonal, whole."""
    tiles = -(-seq // side)
    return matrices * sum(
        min(seq, (i + 1) * side) * min(side, seq - i * side) for i in range(tiles)
    )


def test_the_flash_baseline_computes_what_its_kernels_do_with_no_n2_bytes():
    """flash_baseline: per element of S its kernels compute (causal, whole tiles to the
    diagonal), 2 tile GEMMs forward and 7 backward (3.5x, S and dP in both backward kernels), an
    exp2 a kernel, the elementwise ops and accumulators of FLASH_KERNELS; and bytes linear in
    the sequence, where the unfused attention's S (and its softmax) grows with its square."""
    from megatron_abft.flash.tiles import blocks

    shape = ModelShape("m", 2, 256, 4, 1024, 1000, seq=512, micro_batch=2)  # head dim 64
    work = flash_baseline(shape)
    assert list(work) == list(FLASH_KERNELS) == ["forward", "dkdv", "dq"]  # tiles.KERNELS
    matrices, width = shape.micro_batch * shape.heads, 64
    for kernel, w in work.items():
        tiles = blocks(kernel, width, torch.bfloat16)
        side, loop = (
            (tiles.block_n, tiles.block_m) if kernel == "dkdv" else (tiles.block_m, tiles.block_n)
        )
        elements = _computed(shape.seq, side, matrices)
        spec = FLASH_KERNELS[kernel]
        assert w.flops == pytest.approx(spec.gemms * 2 * width * elements)
        assert w.exps == pytest.approx(elements)
        assert w.vector == pytest.approx(
            elements * (spec.elementwise + spec.accumulators * 64 / loop)
        )
        assert w.ops == spec.launch_ops
    assert (FLASH_KERNELS["dkdv"].gemms + FLASH_KERNELS["dq"].gemms) / 2 == 3.5
    long = replace(shape, seq=8192)
    flops = {k: w.flops for k, w in flash_baseline(long).items()}
    assert (flops["dkdv"] + flops["dq"]) / flops["forward"] == pytest.approx(3.5, rel=0.02)
    double = replace(shape, seq=2 * shape.seq)
    assert sum(w.bytes for w in flash_baseline(double).values()) == pytest.approx(
        2 * sum(w.bytes for w in work.values())
    )
    assert unfused_scores_bytes(double) == 4 * unfused_scores_bytes(shape)
    assert unfused_scores_bytes(replace(SHAPES["GPT-3 350M"], micro_batch=8)) == 2**30  # 1 GiB
    memory = DeviceProfile("m", {"bf16": 1e30}, 1e12, 0.0)  # prices bytes alone
    softmax = [softmax_seconds(s, memory, "forward") for s in (shape, double)]
    assert softmax[1] == pytest.approx(4 * softmax[0])  # S read, P written: O(seq^2)
    # the flash step: the unfused scores and context (forward and backward) and the softmax
    # (both ways) out, the flash kernels in
    h100 = DEVICES["H100"]
    replaced = sum((baseline_forward(long)[p] for p in FLASH_REPLACES), Work())
    softmax = sum(softmax_seconds(long, h100, p) for p in ("forward", "backward"))
    core = h100.time(sum(flash_baseline(long).values(), Work()), "bf16")
    assert step_time(long, h100) - step_time(long, h100, flash=True) == pytest.approx(
        long.layers * (h100.time(replaced * 3, "bf16") + softmax - core)
    )


def _kernel_tiles(shape: ModelShape, kernel: str) -> tuple[float, int]:
    """Elements of S ``kernel`` computes for ``shape`` (TP 1, head dim padded to 64, bf16) and
    the side of the tiles its programs loop over."""
    from megatron_abft.flash.tiles import blocks

    t = blocks(kernel, 64, torch.bfloat16)
    side, loop = (t.block_n, t.block_m) if kernel == "dkdv" else (t.block_m, t.block_n)
    return _computed(shape.seq, side, shape.micro_batch * shape.heads), loop


def test_each_flash_check_costs_its_reference_mma_row_sums_and_comparisons():
    """flash_protection for a small shape, section by section. A check of S or dP (``summed``)
    adds C's rows up (an add an element) and compares them once a program with one 16-wide MMA
    of the program's head_dim-wide tile: 16 x head_dim x 2 FLOPs and CHECK_ROW_OPS a row. An
    accumulating GEMM's check (the context, dV, dK, dQ) runs a 16-wide MMA a tile (16 over
    head_dim of the GEMM), its mass (for dQ a second MMA, of |dS|: an AND for two elements) or
    the forward's rescale, and compares the output's row sums once a program. The dQ kernel
    checks S and dP by its identities (their sums are flash_shared's): a comparison a row. No
    bytes, no launches."""
    shape = replace(FLASH_SHAPE, seq=512)  # head dim 48, padded to 64
    width = 64
    (fwd, f), (dkdv, k), (dq, q) = (_kernel_tiles(shape, kernel) for kernel in FLASH_KERNELS)
    scores, context, bwd_scores, grad_probs, grad_v, grad_k, grad_q = FLASH_SECTIONS
    own = flash_protection(shape)
    assert list(own) == list(FLASH_SECTIONS)
    assert {c.section for c in FLASH_CHECKS} == set(FLASH_SECTIONS)
    rows = shape.micro_batch * shape.heads * shape.seq  # each in one program a kernel

    def gemm(elements):  # one tile GEMM's FLOPs over S
        return 2 * width * elements

    summed = rows * 2 * 16 * width
    flops = {
        scores: summed,
        context: 16 / width * gemm(fwd),
        bwd_scores: summed,
        grad_probs: summed,
        grad_v: 16 / width * gemm(dkdv),
        grad_k: 16 / width * gemm(dkdv),
        grad_q: 2 * 16 / width * gemm(dq),
    }
    r = CHECK_ROW_OPS
    compared = rows * r
    deferred = rows * (width + r)
    vector = {
        scores: fwd + compared,
        context: fwd * 16 / f + deferred,
        bwd_scores: dkdv + compared + compared,
        grad_probs: dkdv + compared + compared,
        grad_v: deferred,
        grad_k: deferred,
        grad_q: dq / 2 + deferred,
    }
    for section, work in own.items():
        assert work.flops == pytest.approx(flops[section]), section
        assert work.vector == pytest.approx(vector[section]), section
        assert work.bytes == work.ops == work.exps == 0
    assert flash_shared(shape)["identities"].vector == pytest.approx(dq * IDENTITY_OPS)


def test_the_flash_checks_cost_less_as_head_dim_grows_whatever_the_tiles(monkeypatch):
    """The in-kernel checks' share of the flash kernels' time falls as the head dim grows (the
    reference of a P or dS tile is 16 / head_dim of its GEMM), and hardly moves with the tiles'
    side: the checks of S and dP and every comparison run once a program, not once a tile.
    Tiles of one side for every kernel."""
    from megatron_abft.flash.tiles import Blocks
    from megatron_abft.tuning import flash_work

    device = DEVICES["H100"]

    def share(head_dim, side):
        monkeypatch.setattr(
            flash_work, "blocks", lambda kernel, width, dtype: Blocks(side, side, 4, 2)
        )
        shape = ModelShape("m", 4, 1024, 1024 // head_dim, 4096, 1000, seq=2048, micro_batch=2)
        own = sum(flash_protection(shape).values(), Work())
        kernels = sum(flash_baseline(shape).values(), Work())
        return device.check_time(own, "bf16") / device.time(kernels, "bf16")

    sides = (16, 32, 64, 128)
    for side in sides:
        assert share(64, side) > share(128, side)
    for head_dim in (64, 128):
        found = [share(head_dim, side) for side in sides]
        assert max(found) < 1.1 * min(found), found


def test_the_flash_path_predicts_every_section_and_its_shared_work_once_a_step():
    """predict(..., "flash"): every section of SECTIONS, the backward's counted; qkv and proj as
    the kernels check them; each flash section's figure is its own work and the shared work,
    which the step pays once on any step that checks any flash section; against the flash
    step. The unfused predictions keep FORWARD_SECTIONS and no shared work; what an
    implementation does not check, or does not know, is refused."""
    shape = replace(SHAPES["GPT-3 350M"], seq=2048)
    device = DEVICES["H100"]
    every = predict(shape, device, "flash")
    base = step_time(shape, device, flash=True)
    assert list(every.sections) == list(SECTIONS) and every.step_seconds == base
    own = {s: every.sections[s] - every.shared * (s in FLASH_SECTIONS) for s in SECTIONS}
    assert every.shared > 0 and all(own[s] > 0 for s in SECTIONS)
    assert every.step == pytest.approx(sum(own.values()) + every.shared)
    assert 0 < every.step < every.attention
    kernels = protection_forward(
        shape, "kernels", device.ops_per_check("kernels"), device.ops_per_bias("kernels")
    )
    outside = tuple(s for s in SECTIONS if s not in FLASH_SECTIONS)
    for s in outside:
        assert own[s] == pytest.approx(device.check_time(kernels[s], "bf16") * shape.layers / base)
    backward = predict(shape, device, "flash", sections=BACKWARD_SECTIONS)
    assert backward.step == pytest.approx(sum(own[s] for s in BACKWARD_SECTIONS) + every.shared)
    halved = predict(shape, device, "flash", intervals=dict.fromkeys(FLASH_SECTIONS, 2))
    in_flash = sum(own[s] for s in FLASH_SECTIONS) + every.shared
    assert halved.step == pytest.approx(every.step - in_flash / 2)
    around = predict(shape, device, "flash", sections=outside)
    assert around.step == pytest.approx(sum(own[s] for s in outside))
    fused = predict(shape, device, "fused")
    assert list(fused.sections) == list(FORWARD_SECTIONS) and fused.shared == 0
    with pytest.raises(ValueError, match="impl 'triton'"):
        predict(shape, device, "triton")
    with pytest.raises(ValueError, match="impl 'kernels' checks"):
        predict(shape, device, "kernels", sections=BACKWARD_SECTIONS[-1:])
    with pytest.raises(ValueError, match="flash_protection"):
        protection_forward(shape, "flash")
    with pytest.raises(ValueError, match="dtype 'fp32'"):
        predict(replace(shape, dtype="fp32"), device, "flash")
    with pytest.raises(ValueError, match="no vector rate"):
        predict(shape, DeviceProfile("cpu", {"bf16": 1e12}, 1e10, 1e-5), "flash")
