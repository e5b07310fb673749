"""What the overhead model (megatron_abft.tuning.scaling) counts: model shapes, the shapes users
train (CATALOGUE), and amounts of work (Work)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


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
    """An amount of work: GEMM FLOPs on the tensor cores (a CPU's BLAS), bytes moved by
    memory-bound ops, tensor ops launched, the dot products of the checks' products kernels (a
    row of an operand against one checksum vector; their multiply-adds are in ``vector``), fp32
    ops on the CUDA cores (a CPU's vector units; ``vector``, an FMA one: the checksum products'
    multiply-adds and the flash kernels' elementwise work), exponentials on the
    special-function units (``exps``), and, of the checks' work that runs as library ops rather
    than the checksum kernels (the products on the tensor cores), the bytes those ops move
    (``stream``) and the ops themselves (``launches``)."""

    flops: float = 0.0
    bytes: float = 0.0
    ops: float = 0.0
    dots: float = 0.0
    vector: float = 0.0
    exps: float = 0.0
    stream: float = 0.0
    launches: float = 0.0

    def __add__(self, other: Work) -> Work:
        return Work(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(Work)))

    def __mul__(self, factor: float) -> Work:
        return Work(*(getattr(self, f.name) * factor for f in fields(Work)))


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
