"""Ahead-of-time builds of every flash kernel configuration the code can launch, for NVIDIA GPUs,
on any machine: Triton compiles an ``ASTSource`` for a ``GPUTarget`` without a GPU (through
ptxas to a cubin), and the bundled cuobjdump reads the cubin's registers, stack and local
memory. What the interpreter cannot catch shows here: a kernel that does not build for the
target, shared memory above the device's limit, registers that spill.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from megatron_abft.flash import kernels, launch

ARCHS: dict[int, int] = {80: 166912, 90: 232448}
"""Compute capability -> the most shared memory a block may use there, in bytes (A100: 163 KiB,
H100: 227 KiB)."""
VARIANTS: tuple[str, ...] = ("checked", "unchecked", "inject", "calibrate")
"""What is compiled in: the checks (production), nothing (sections=()), the checks with fault
injection (faults=...), the checks with calibration (tools/flash_calibrate.py)."""
KERNEL_FUNCTIONS = {
    "forward": "_fwd_kernel",
    "dkdv": "_bwd_dkdv_kernel",
    "dq": "_bwd_dq_kernel",
}
_TRITON_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_FLOATS = {"qk_scale", "sm_scale", "tol", "u_out", "near_inf"}
_CHECKSUMS = {"KC", "VR", "QC", "QR", "DOC", "DOR", "KR", "VC"}
_DATA = {"Q", "K", "V", "OUT", "DO", "DQ", "DK", "DV"} | _CHECKSUMS
_FP32 = {"LSE", "DELTA", "ODO"} | {name + "S" for name in _CHECKSUMS}
_INT32 = {"CODES", "ROWS", "COLS", "RATIO", "INJ"}


@dataclass(frozen=True)
class Config:
    """One kernel configuration, as launch.py launches it."""

    kernel: str
    dtype: str
    head_dim: int
    causal: bool
    variant: str
    tiles: launch.Blocks | None = None
    """The tile shape to build with; None: launch.blocks's."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def blocks(self) -> launch.Blocks:
        if self.tiles is not None:
            return self.tiles
        return launch.blocks(self.kernel, self.head_dim, self.torch_dtype)


def configurations() -> list[Config]:
    """Every configuration launch.py can launch on a GPU."""
    return [
        Config(kernel, str(dtype).removeprefix("torch."), width, causal, variant)
        for kernel in launch.KERNELS
        for dtype in launch.GPU_DTYPES
        for width in launch.HEAD_DIMS
        for causal in (False, True)
        for variant in VARIANTS
    ]


def source(config: Config) -> ASTSource:
    """The kernel of ``config`` with its signature as a launch specialises it: unit last-dim
    strides, 16-byte aligned pointers, other strides multiples of 16."""
    fn = getattr(kernels, KERNEL_FUNCTIONS[config.kernel])
    blocks = config.blocks
    constants = {
        "BLOCK_M": blocks.block_m,
        "BLOCK_N": blocks.block_n,
        "HEAD_DIM": config.head_dim,
        "CAUSAL": config.causal,
        "CHECK": config.variant != "unchecked",
        "INJECT": config.variant == "inject",
        "CALIBRATE": config.variant == "calibrate",
        "UPCAST": False,
    }
    data = _TRITON_TYPES[config.torch_dtype]
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constants:
            signature[name] = "constexpr"
        elif re.fullmatch(r"s\w+d", name):  # the head dim's stride: 1
            signature[name], constants[name] = "constexpr", 1
        elif name in _DATA | _FP32 | _INT32:
            if name in _DATA:
                signature[name] = "*" + data
            elif name in _FP32 or (name == "RATIO" and config.variant == "calibrate"):
                signature[name] = "*fp32"
            else:
                signature[name] = "*i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in _FLOATS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if re.fullmatch(r"s\w+", name):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(fn, signature, constants, attrs)


@dataclass(frozen=True)
class Build:
    """What one configuration's build for one architecture uses."""

    config: Config
    arch: int
    shared: int
    """Shared memory, bytes."""
    registers: int
    """Per thread."""
    stack: int
    """Per-thread stack frame, bytes: spilled registers live there."""
    local: int
    seconds: float

    @property
    def problems(self) -> list[str]:
        found = []
        if self.shared > ARCHS[self.arch]:
            found.append(f"shared memory {self.shared} B > {ARCHS[self.arch]} B")
        if self.stack or self.local:
            found.append(f"spills: stack {self.stack} B, local {self.local} B")
        return found

    def as_dict(self) -> dict:
        return {**asdict(self), "problems": self.problems}


def _cuobjdump() -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def build(config: Config, arch: int) -> Build:
    """Compile ``config`` for ``sm_<arch>`` and read what it uses."""
    start = time.perf_counter()
    blocks = config.blocks
    compiled = triton.compile(
        source(config),
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": blocks.num_warps, "num_stages": blocks.num_stages},
    )
    seconds = time.perf_counter() - start
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run(
            [_cuobjdump(), "--dump-resource-usage", cubin.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    fields = dict(re.findall(r"\b(REG|STACK|LOCAL):(\d+)", usage))
    return Build(
        config,
        arch,
        compiled.metadata.shared,
        int(fields["REG"]),
        int(fields["STACK"]),
        int(fields["LOCAL"]),
        seconds,
    )


def _build(job: tuple[Config, int]) -> Build:
    return build(*job)


def build_all(
    configs: list[Config] | None = None, archs: tuple[int, ...] = tuple(ARCHS), workers: int = 0
) -> list[Build]:
    """Build every configuration for every architecture, ``workers`` processes at once
    (0: one a CPU)."""
    jobs = [(c, a) for c in (configs if configs is not None else configurations()) for a in archs]
    workers = workers or os.cpu_count() or 1
    if workers == 1:
        return [_build(job) for job in jobs]
    with ProcessPoolExecutor(workers) as pool:
        return list(pool.map(_build, jobs))
