"""Run megatron-core 0.19.2 unchanged on a CPU-only host (gloo), with the CUDA build of torch.

``enable_cpu_mode()`` is the only place that patches Megatron and torch for this. Each patch is a
small function whose docstring names the megatron-core code path (file:line under
``megatron/core`` in 0.19.2) that fails without it. Call it in every process, before or after
``torch.distributed.init_process_group("gloo", ...)``.

RNG: on the CPU, dropout draws from the CPU default generator, so the RNG states tracker keeps
CPU generator states and ``tensor_parallel.model_parallel_cuda_manual_seed(seed)`` gives each TP
rank its own ``model-parallel-rng`` stream (``seed + 2718 + tp_rank``), as on a GPU. Its
``torch.cuda.manual_seed(seed)`` does nothing without a GPU: seed the stream for dropout outside
TP regions, the CPU default generator, with ``torch.manual_seed`` as Megatron-LM does.
"""

from __future__ import annotations

import contextlib
import importlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from megatron.core.tensor_parallel import random as mpu_random
from torch.overrides import TorchFunctionMode

__all__ = ["CpuRNGStatesTracker", "enable_cpu_mode", "is_cpu_mode_enabled"]

_ENABLED = False

# Modules whose code calls torch factories with device="cuda" on the paths we run.
_CUDA_FACTORY_MODULES = (
    "megatron.core.transformer.utils",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.rerun_state_machine",
    "megatron.core.utils",
)


class CpuRNGStatesTracker(mpu_random.CudaRNGStatesTracker):
    """Megatron's RNG states tracker, holding states of the CPU default generator."""

    def add(self, name: str, seed: int) -> None:
        """Track a new state ``name`` seeded with ``seed``."""
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = mpu_random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Run the block on state ``name`` of the CPU generator, then restore the caller's."""
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig_state = torch.get_rng_state()
        orig_name = self._current_state_name
        if orig_name != "default-rng":
            self.states_[orig_name] = orig_state
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            if self._current_state_name != name:
                raise Exception(f"current rng state {self._current_state_name} is not {name}")
            self.states_[name] = torch.get_rng_state()
            if orig_name != "default-rng":
                orig_state = self.states_[orig_name]
            torch.set_rng_state(orig_state)
            self._current_state_name = orig_name


def _is_cuda(device: Any) -> bool:
    """Whether ``device`` (a ``torch.device`` or a string) is a CUDA device."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


class _TorchOnCpu(types.ModuleType):
    """``torch`` as one Megatron module sees it: factories asked for "cuda" build on the CPU."""

    _FACTORIES = frozenset({"empty", "full", "ones", "tensor", "zeros"})

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        attr = getattr(torch, name)
        if name not in self._FACTORIES:
            return attr

        def factory(*args: Any, **kwargs: Any) -> torch.Tensor:
            if _is_cuda(kwargs.get("device")):
                kwargs["device"] = "cpu"
            return attr(*args, **kwargs)

        setattr(self, name, factory)  # later lookups skip __getattr__
        return factory


class _CudaTypeNames(TorchFunctionMode):
    """Torch function mode under which ``Tensor.type()`` names CPU tensors as CUDA ones."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return result.replace("torch.", "torch.cuda.", 1)
        return result


def _empty_cuda_rng_state(device: Any = "cuda") -> torch.Tensor:
    """The CUDA RNG state of a host without a GPU: nothing."""
    return torch.empty(0, dtype=torch.uint8)


def _install_cpu_rng_tracker() -> None:
    """tensor_parallel/random.py:303,318: tracker add/fork read the CUDA generator; every
    DotProductAttention forward forks it (dot_product_attention.py:217)."""
    mpu_random.CudaRNGStatesTracker = CpuRNGStatesTracker  # built by random.py:383 from now on
    if not isinstance(mpu_random._CUDA_RNG_STATE_TRACKER, CpuRNGStatesTracker):
        mpu_random.initialize_rng_tracker(force_reset=True)


def _cuda_rng_state_is_empty() -> None:
    """tensor_parallel/random.py:118 (recompute's _get_all_rng_states, random.py:528) and
    rerun_state_machine.py:979 (_save_state) read the CUDA RNG state."""
    torch.cuda.get_rng_state = torch.cuda.random.get_rng_state = _empty_cuda_rng_state


def _skip_recompute_cuda_rng_restore() -> None:
    """tensor_parallel/random.py:538: each recompute sets the CUDA RNG state via _lazy_call, which
    without a GPU is queued in torch.cuda._queued_calls, never run and never freed."""
    mpu_random._set_cuda_rng_state = lambda *args, **kwargs: None


def _current_device_is_cpu() -> None:
    """utils.py:715 (GlobalMemoryBuffer: DotProductAttention scores), rotary_pos_embedding.py:162
    (RoPE) and ~200 more sites allocate on ``torch.cuda.current_device()``."""
    torch.cuda.current_device = torch.cpu.current_device


def _cpu_current_stream() -> None:
    """distributed/param_and_grad_buffer.py:632: DDP finish_grad_sync gets the current stream."""
    torch.cuda.current_stream = torch.cpu.current_stream


def _cpu_synchronize() -> None:
    """dist_checkpointing/strategies/filesystem_async.py:248: checkpoint save synchronizes."""
    torch.cuda.synchronize = torch.cpu.synchronize


def _cuda_factories_to_cpu() -> None:
    """transformer/utils.py:39 (causal mask for attention_mask=None), pipeline_parallel/
    schedules.py:749, optimizer/optimizer.py:1249, optimizer/clip_grads.py:108,180,
    rerun_state_machine.py:264,268 and utils.py:1332 build tensors with ``device="cuda"``."""
    for name in _CUDA_FACTORY_MODULES:
        module = importlib.import_module(name)
        if not isinstance(module.torch, _TorchOnCpu):
            module.torch = _TorchOnCpu()


def _clip_grads_accept_cpu_grads() -> None:
    """optimizer/clip_grads.py:174: clip_grad_by_total_norm_fp32 (optimizer.py:410,1906)
    asserts ``grad.type() == 'torch.cuda.FloatTensor'``."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mcore_optimizer

    original = clip_grads.clip_grad_by_total_norm_fp32
    if getattr(original, "_on_cpu", False):
        return

    def clip_grad_by_total_norm_fp32(*args: Any, **kwargs: Any) -> None:
        with _CudaTypeNames():
            return original(*args, **kwargs)

    clip_grad_by_total_norm_fp32._on_cpu = True  # type: ignore[attr-defined]
    clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    mcore_optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32


_PATCHES: tuple[Callable[[], None], ...] = (
    _install_cpu_rng_tracker,
    _cuda_rng_state_is_empty,
    _skip_recompute_cuda_rng_restore,
    _current_device_is_cpu,
    _cpu_current_stream,
    _cpu_synchronize,
    _cuda_factories_to_cpu,
    _clip_grads_accept_cpu_grads,
)


def enable_cpu_mode() -> bool:
    """Patch megatron-core and torch to run on the CPU; return whether CPU mode is on.

    Idempotent, and a no-op returning False when CUDA is available.
    """
    global _ENABLED
    if torch.cuda.is_available():
        return False
    if not _ENABLED:
        for patch in _PATCHES:
            patch()
        _ENABLED = True
    return True


def is_cpu_mode_enabled() -> bool:
    """Whether ``enable_cpu_mode()`` has patched this process."""
    return _ENABLED
