"""Test harness: tiny Megatron-core GPT models on gloo ranks, on CPU.

``spawn(world, tp, fn, *args)`` runs ``fn(*args)`` on ``world`` processes with tensor-parallel
size ``tp`` and returns each rank's return value. Workers are module-level functions so they can
be pickled; one spawn should run many cases, since starting a rank costs seconds.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import socket
import tempfile
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    """A port free now, below Linux's ephemeral range (32768 and up): a port the kernel hands
    out itself can be handed again to another process's gloo connection before rank 0 binds it
    (EADDRINUSE), while a port outside that range is only ever taken by an explicit bind."""
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(20000, 32768)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32767 after 100 tries")


MEGATRON_LM_FLAGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
    "--train-iters", "5", "--lr", "1e-3", "--vocab-size", "128",
    "--tokenizer-type", "NullTokenizer", "--mock-data", "--transformer-impl", "local",
    "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-persist-layer-norm",
    "--no-rope-fusion", "--use-cpu-initialization",
    "--spec", "megatron_abft.spec", "get_gpt_layer_abft_spec",
]  # fmt: skip
"""Megatron-LM's own flags for a tiny GPT on CPU on the protected spec (with ``--abft``), for
the tests that run Megatron-LM's parser and model builder."""


PRELOAD = ("megatron.core.models.gpt", "megatron_abft.spec", "megatron_abft.cpu")
"""What the ranks' fork server imports once, for every rank it starts."""


def start_ranks(worker, args: tuple, nprocs: int) -> None:
    """Run ``worker(rank, *args)`` on ``nprocs`` processes and join them. They fork from a
    server that has imported Megatron-core once (multiprocessing's forkserver, started per
    pytest worker): a fresh interpreter would pay about 10 s of imports a rank. The server
    runs no torch op, so forking it is safe."""
    multiprocessing.set_forkserver_preload(list(PRELOAD))
    mp.start_processes(
        _in_directory,
        args=(os.getcwd(), worker, *args),
        nprocs=nprocs,
        join=True,
        start_method="forkserver",
    )


def _in_directory(rank, directory, worker, *args):
    """``worker(rank, *args)`` in the caller's working directory (each test's own), where a
    spawned process would start: a forked one starts in its server's."""
    os.chdir(directory)
    worker(rank, *args)


def _worker(rank, world, tp, port, out_dir, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from megatron_abft.cpu import enable_cpu_mode

    enable_cpu_mode()
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    try:
        result = fn(*args)
    except Exception as error:  # handed to the parent, which re-raises with the rank
        result = error
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def spawn(world: int, tp: int, fn, *args) -> list:
    """Each rank's return value (or the exception it raised)."""
    with tempfile.TemporaryDirectory() as out_dir:
        start_ranks(_worker, (world, tp, free_port(), out_dir, fn, args), world)
        return [
            torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
            for r in range(world)
        ]


@dataclass(frozen=True)
class Shape:
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    groups: int | None = None
    seq: int = 32
    vocab: int = 128
    batch: int = 2
    dtype: torch.dtype = torch.float32
    dropout: float = 0.0
    padding: bool = False
    """Pass an explicit causal + padding mask instead of None (Megatron's implicit causal mask)."""
    recompute: str | None = None
    """Activation recompute: None, "selective" (core attention) or "full"."""
    sequence_parallel: bool = False


def build_gpt(shape: Shape, spec):
    """A GPTModel with RoPE whose weights are the same for every TP size (CPU initialisation)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=shape.layers,
        hidden_size=shape.hidden,
        num_attention_heads=shape.heads,
        num_query_groups=shape.groups,
        tensor_model_parallel_size=_tp_size(),
        use_cpu_initialization=True,
        params_dtype=shape.dtype,
        bf16=shape.dtype == torch.bfloat16,
        fp16=shape.dtype == torch.float16,
        hidden_dropout=0.0,
        attention_dropout=shape.dropout,
        add_bias_linear=True,
        recompute_granularity=shape.recompute,
        recompute_method="uniform" if shape.recompute == "full" else None,
        recompute_num_layers=1 if shape.recompute == "full" else None,
        sequence_parallel=shape.sequence_parallel,
    )
    if shape.sequence_parallel:  # the final norm too: the layer spec's torch norm takes SP
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

        from megatron_abft.layers.norm import SequenceParallelTorchNorm

        spec = TransformerBlockSubmodules(
            layer_specs=[spec] * shape.layers, layer_norm=SequenceParallelTorchNorm
        )
    torch.manual_seed(1234)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=shape.vocab,
        max_sequence_length=shape.seq,
        position_embedding_type="rope",
    )


def _tp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()


def batch(shape: Shape, step: int):
    """Tokens, positions, the attention mask (None: causal) and labels of one micro-batch."""
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, shape.vocab, (shape.batch, shape.seq + 1), generator=g)
    positions = torch.arange(shape.seq).unsqueeze(0).expand(shape.batch, shape.seq)
    mask = None
    if shape.padding:  # True = masked: the future, and the last few keys of every sequence
        causal = torch.ones(shape.seq, shape.seq, dtype=torch.bool).triu(1)
        lengths = shape.seq - torch.arange(shape.batch) * 3
        padded = torch.arange(shape.seq) >= lengths[:, None]
        mask = (causal | padded[:, None, :])[:, None]
    return tokens[:, :-1], positions, mask, tokens[:, 1:]


def loss_and_grads(model, shape: Shape, step: int = 0):
    """One forward and backward: the loss and the TP-gathered gradients of the attention's
    weights and its input norm (summed over the ranks under sequence parallelism)."""
    from megatron.core import parallel_state

    tokens, positions, mask, labels = batch(shape, step)
    model.zero_grad(set_to_none=True)
    loss = model(tokens, positions, mask, labels=labels).float().mean()
    loss.backward()
    group = parallel_state.get_tensor_model_parallel_group()
    tp = parallel_state.get_tensor_model_parallel_world_size()

    def gathered(t, dim):
        parts = [torch.empty_like(t) for _ in range(tp)]
        torch.distributed.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts, dim=dim).float()

    def summed(param):  # a sequence-parallel norm's gradient is a partial sum on each rank
        grad = param.grad.clone()
        if getattr(param, "sequence_parallel", False):
            torch.distributed.all_reduce(grad, group=group)
        return grad.float()

    grads = {}
    for i, layer in enumerate(model.decoder.layers):
        attention = layer.self_attention
        grads[f"{i}.qkv"] = gathered(attention.linear_qkv.weight.grad, 0)
        grads[f"{i}.proj"] = gathered(attention.linear_proj.weight.grad, 1)
        grads[f"{i}.norm"] = summed(layer.input_layernorm.weight)
    grads["embedding"] = gathered(model.embedding.word_embeddings.weight.grad, 0)
    return loss.detach(), grads
