"""The flash attention's work for the overhead model (megatron_abft.tuning.scaling), counted from
megatron_abft.flash's kernels and launches: its kernels with the checks compiled out
(flash_baseline), each flash section's own checks (flash_protection), and what a step runs once
whenever any flash section is due (flash_shared)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_abft.config import DTYPE_NAMES, FLASH_SECTIONS, FORWARD_SECTIONS
from megatron_abft.flash.tiles import GPU_DTYPES, WIDTH, blocks, padded_head_dim
from megatron_abft.tuning.shapes import BYTES, ModelShape, Work

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
IDENTITY_OPS = 1
"""CUDA-core ops an element of S the dQ kernel spends on its row identities when bwd_scores or
grad_probs is due: sum P (their bounds take |dP| from the rows' norms, per row). Sum dS comes
out of grad_q's reference MMA and its mass MMA, whose checksum tile holds a column of ones."""
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
    raw: int = 0
    """fp32 values a row written, then read again by the head's last program (SPLIT)."""
    launches: int = 1


PREPASS = {
    "forward": (Prepass(False, 1, columns=1), Prepass(False, 1, rows=1, launches=0)),
    "dkdv": (Prepass(True, 1, rows=2, columns=2, stats=8, launches=0),),
    "dq": (Prepass(False, 1, rows=1, launches=0), Prepass(False, 1, rows=1, launches=0)),
}
"""The checksum tiles launch.py makes before each kernel when all its sections are due: the
forward's of K (the prefix sums of its columns, added up by the last program of each head:
checksums.key_value_sums) and of V (rows) in the same launch, tiled by its block_n; the
backward's in the prologue that computes Delta anyway (checksums.backward, no launch of its
own): dK/dV's (a tile of dO's rows and one of Q's, stacked, their suffix column sums, from one
more read of Q), tiled by its block_m, and dQ's of K and V (rows), by its block_n."""
SPLIT = {
    "forward": Prepass(False, 0, stats=0, raw=2, launches=0),
    "dkdv": Prepass(True, 0, stats=2, raw=5, launches=0),
    "dq": Prepass(False, 0, stats=0, raw=4, launches=0),
}
"""For a dtype whose checksum parts carry a scale (SCALED), one scale a head: each kernel's
row sums leave the tile programs in fp32 (``raw`` values a row: V's sum and absolute sum; K's
and V's; dO's three and Q's two) and the last program of each head splits them at the head's
scale, in the same launch; dK/dV's tiles' peaks of dO and Q apart, the others' into the stats
PREPASS counts."""
SCALED = ("fp16",)
"""The dtypes whose checksum parts carry a scale (megatron_abft.flash.checksums.HEADROOM)."""
FOUND_OPS = 1
"""Launches of one call's findings buffer (launch.Findings.empty: one zero fill), made by each of
the forward's and the backward's ops when they check anything. The ledger's update takes none
of its own: the last program of the op's last second launch makes it (kernels._record)."""


def _prepass(f: _FlashShape, p: Prepass, block: int) -> Work:
    """One of PREPASS's launches for ``block``-row tiles: the operands it reads, and the tiles
    and stats it writes (the column sums twice more in fp32, through the running sums)."""
    e = BYTES[f.dtype]
    matrices = f.queries if p.query else f.keys
    tiles = -(-f.seq // block)
    tile = p.rows * block * WIDTH * e + p.stats * 4 + 2 * p.raw * block * 4
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
    By part: ``prepass``, the checksum tiles (PREPASS, and SPLIT where SCALED); ``odo``, the
    backward's rounding of Delta (``sum |O| |dO|`` a row, which the prologue writes beside
    Delta); ``identities``, the dQ kernel's row identities (IDENTITY_OPS); ``retry``, each
    kernel's second launch (RETRY_OPS); ``ledger``, the findings buffers (FOUND_OPS) of the
    forward and the backward. The kernels' reads of the tiles, a tile's at a time and mostly
    from L2, are left out."""
    f = _FlashShape.of(shape)
    prepass = Work()
    for kernel, launches in PREPASS.items():
        if f.dtype in SCALED:
            launches += (SPLIT[kernel],)
        for p in launches:
            prepass += _prepass(f, p, f.tiles(kernel)[1])
    return {
        "prepass": prepass,
        "odo": Work(bytes=f.queries * f.seq * 4),
        "identities": Work(vector=f.computed("dq") * IDENTITY_OPS),
        "retry": Work(ops=RETRY_OPS),
        # the findings buffers (codes, rows, columns of each section and matrix, the count of
        # the programs done, and three counters a head for the checksum launches), zero-filled
        "ledger": Work(
            ops=2 * FOUND_OPS, bytes=2 * ((3 * len(FLASH_SECTIONS) + 3) * f.queries + 1) * 4
        ),
    }
