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

from megatron_abft.config import DTYPE_NAMES
from megatron_abft.flash import checksums, kernels, launch, ledger

ARCHS: dict[int, int] = {80: 166912, 90: 232448}
"""Compute capability -> the most shared memory a block may use there, in bytes (A100: 163 KiB,
H100: 227 KiB)."""
VARIANTS: tuple[str, ...] = ("checked", "unchecked", "inject", "calibrate")
"""What the attention kernels compile in: the checks (production), nothing (sections=()), the
checks with fault injection (faults=...), the checks with calibration
(tools/flash_false_alarms.py)."""
HELPERS: tuple[str, ...] = ("delta", "sums", "record")
"""The kernels around them: Delta (launch.backward), the checksum vectors (checksums.sums) and
the ledger's update (ledger.record)."""
_FLOATS = {"qk_scale", "sm_scale", "tol", "u_out", "near_inf"}
_CHECKSUMS = {"KC", "VR", "QC", "QR", "DOC", "DOR", "KR", "VC"}
_POINTERS = {
    **dict.fromkeys({"Q", "K", "V", "OUT", "DO", "DQ", "DK", "DV", "X", "CP", "RP"}, "data"),
    **dict.fromkeys(_CHECKSUMS, "data"),
    **dict.fromkeys({"LSE", "DELTA", "ODO", "CS", "RS"} | {c + "S" for c in _CHECKSUMS}, "fp32"),
    **dict.fromkeys({"CODES", "ROWS", "COLS", "RATIO", "INJ"}, "i32"),
    **dict.fromkeys({"COUNTS", "LOGGED"}, "i64"),
    **dict.fromkeys({"CLOCK", "LOG"}, "fp64"),
}
"""Every kernel argument that is a pointer, and what it points to (data: the input dtype)."""


@dataclass(frozen=True)
class Config:
    """One kernel configuration, as the flash path launches it: an attention kernel
    (launch.KERNELS) in one of VARIANTS, or a helper (HELPERS) with its constexpr options."""

    kernel: str
    dtype: str
    head_dim: int
    causal: bool = False
    variant: str = "checked"
    tiles: launch.Blocks | None = None
    """The tile shape to build with; None: launch.blocks's."""
    options: tuple[tuple[str, object], ...] = ()
    """A helper's constexprs beyond HEAD_DIM."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def blocks(self) -> launch.Blocks:
        if self.tiles is not None:
            return self.tiles
        if self.kernel in HELPERS:  # one program a block of rows, 4 warps
            return launch.Blocks(dict(self.options).get("BLOCK", 64), 0, 4, 1)
        return launch.blocks(self.kernel, self.head_dim, self.torch_dtype)

    @property
    def function(self):
        return {
            "forward": kernels._fwd_kernel,
            "dkdv": kernels._bwd_dkdv_kernel,
            "dq": kernels._bwd_dq_kernel,
            "delta": kernels._delta_kernel,
            "sums": checksums._sums_kernel,
            "record": ledger._record_kernel,
        }[self.kernel]


def configurations() -> list[Config]:
    """Every configuration the flash path can launch on a GPU."""
    configs = []
    for dtype in launch.GPU_DTYPES:
        name = str(dtype).removeprefix("torch.")
        for width in launch.HEAD_DIMS:
            configs += [
                Config(kernel, name, width, causal, variant)
                for kernel in launch.KERNELS
                for causal in (False, True)
                for variant in VARIANTS
            ]
            configs += [
                Config("delta", name, width, options=(("BLOCK_M", 64), ("WITH_ODO", odo)))
                for odo in (False, True)
            ]
            tiled = {  # the rows of the tiles each kernel's checksum vectors are made for
                launch.blocks("forward", width, dtype).block_n,
                launch.blocks("dkdv", width, dtype).block_m,
                launch.blocks("dq", width, dtype).block_n,
            }
            configs += [
                Config(
                    "sums",
                    name,
                    width,
                    options=(
                        ("BLOCK", block),
                        ("COLUMNS", columns),
                        ("ROWS", rows),
                        ("HEADROOM", checksums.HEADROOM.get(dtype, 0)),
                    ),
                )  # fmt: skip
                for block in sorted(tiled)
                for columns, rows in ((True, False), (False, True), (True, True))
            ]
    return [*configs, Config("record", "bfloat16", 0, options=(("BLOCK", ledger.RECORD_BLOCK),))]


def source(config: Config) -> ASTSource:
    """The kernel of ``config`` with its signature as a launch specialises it: unit last-dim
    strides, 16-byte aligned pointers, other strides multiples of 16."""
    fn = config.function
    if config.kernel in HELPERS:
        constants = dict(config.options)
        if "HEAD_DIM" in fn.arg_names:
            constants["HEAD_DIM"] = config.head_dim
    else:
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
    data = DTYPE_NAMES[config.torch_dtype]  # Triton's names for them too
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constants:
            signature[name] = "constexpr"
        elif re.fullmatch(r"s\w+d", name):  # the head dim's stride: 1
            signature[name], constants[name] = "constexpr", 1
        elif name in _POINTERS:
            kind = _POINTERS[name]
            if name == "RATIO" and config.variant == "calibrate":
                kind = "fp32"
            signature[name] = "*" + (data if kind == "data" else kind)
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
