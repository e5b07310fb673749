"""Where the tests of the CUDA kernels run: on a GPU where there is one, and on every machine with
the CUDA emulator (megatron_abft.ops.compiled.emulated_cuda), which runs the same kernel source on
the CPU.

A test takes ``gpu`` from ``@pytest.mark.parametrize("gpu", TARGETS)``, puts its inputs on
``gpu.device`` and calls the kernels inside ``with gpu.kernels():``; its references, computed
outside that block, are the C++ kernels' or the PyTorch path's."""

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import pytest
import torch

from megatron_abft.ops import compiled


def emulator_built() -> bool:
    return compiled.emulator_available()


@dataclass(frozen=True)
class Target:
    """A place where the CUDA kernels run: a GPU, or the CPU through the emulator."""

    emulated: bool

    @property
    def device(self) -> torch.device:
        return torch.device("cpu" if self.emulated else "cuda")

    def kernels(self, schedule: int = 0) -> AbstractContextManager:
        return compiled.emulated_cuda(schedule) if self.emulated else nullcontext()


ON_GPU, EMULATOR = Target(emulated=False), Target(emulated=True)
GPU = pytest.param(
    ON_GPU,
    marks=pytest.mark.skipif(
        not (torch.cuda.is_available() and compiled.available()),
        reason="needs a GPU and the extension",
    ),
    id="gpu",
)
EMULATED = pytest.param(
    EMULATOR,
    marks=pytest.mark.skipif(not emulator_built(), reason="no CUDA emulator in this build"),
    id="emulated",
)
TARGETS = [GPU, EMULATED]
