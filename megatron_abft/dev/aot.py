"""Ahead-of-time builds of the flash kernels exactly as the launcher runs them, for NVIDIA GPUs,
on any machine, and what their SASS says: the static speed gate
(tests/flash/test_flash_gate.py, ``python -m tools.flash_sass``).

A ``Case`` is one call of the flash attention (shape, dtype, mask, what it checks). ``capture``
runs the launcher on CPU tensors with every kernel launch recorded instead of run, and
``specialize`` turns a recorded launch into the program Triton would compile for it on a GPU:
its own binder specialises the arguments (16-byte alignment, integers divisible by 16, integers
equal to 1 made constants, as ``GROUP`` is in multi-head attention). Triton then compiles that
program for a ``GPUTarget`` without a GPU, ptxas reports its registers, stack and warnings, and
the bundled cuobjdump gives the SASS that megatron_abft.dev.sass measures.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from megatron_abft.config import FLASH_SECTIONS
from megatron_abft.dev import sass
from megatron_abft.flash import build as kernel_build
from megatron_abft.flash import launch, tiles

ARCHS: dict[int, int] = {80: 166912, 90: 232448}
"""Compute capability -> the most shared memory a block may use there, in bytes (A100: 163 KiB,
H100: 227 KiB)."""
VARIANTS: tuple[str, ...] = ("checked", "unchecked", "inject", "calibrate")
"""What the attention kernels compile in: every check (production), nothing (sections=()), the
checks with fault injection (faults=...), the checks with calibration
(tools/flash_false_alarms.py). Only the first two are held to the gate's budgets; the others
must build."""
ATTENTION = {"_fwd_kernel": "forward", "_bwd_dkdv_kernel": "dkdv", "_bwd_dq_kernel": "dq"}
"""The attention kernels' functions and tiles.KERNELS names; every other launch is a helper
(Delta, the checksum vectors)."""


@dataclass(frozen=True)
class Case:
    """One call of the flash attention, forward and backward, whose launches are built."""

    dtype: str
    """bfloat16 or float16 (tiles.GPU_DTYPES)."""
    head_dim: int
    causal: bool
    variant: str = "checked"
    seq: int = 2048
    heads: int = 16
    kv_heads: int = 16
    batch: int = 2

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclass(frozen=True)
class Launch:
    """A kernel launch as Triton compiles it: the function (by module and name) and its
    specialised signature, constants, attributes and options; picklable."""

    module: str
    name: str
    signature: tuple[tuple[str, str], ...]
    constants: tuple[tuple[object, object], ...]
    attrs: tuple[tuple[object, object], ...]
    options: tuple[tuple[str, object], ...]
    named: tuple[tuple[str, object], ...]
    """The launch's constexprs and options by name (BLOCK_M, num_warps...)."""

    @property
    def kernel(self) -> str:
        """tiles.KERNELS's name of an attention kernel, else the function's."""
        return ATTENTION.get(self.name, self.name.strip("_").removesuffix("_kernel"))

    def get(self, name: str, default: object = None) -> object:
        return dict(self.named).get(name, default)

    @property
    def key(self) -> tuple:
        return (self.module, self.name, self.signature, self.constants, self.attrs, self.options)


class _Recorder:
    """Stands in for a kernels module: a launch of any of its kernels is recorded, not run."""

    def __init__(self, module, launches: list) -> None:
        self._module, self._launches = module, launches

    def __getattr__(self, name: str):
        return _Launch(getattr(self._module, name), self._launches)


class _Launch:
    """One kernel of a _Recorder: ``kernel[grid](*args, **kwargs)`` records (kernel, args,
    kwargs)."""

    def __init__(self, fn, launches: list) -> None:
        self._fn, self._launches = fn, launches

    def __getitem__(self, grid) -> _Launch:
        return self

    def __call__(self, *args, **kwargs) -> None:
        self._launches.append((self._fn, args, kwargs))


@contextlib.contextmanager
def recording(launches: list) -> Iterator[None]:
    """Within the block, the flash kernels' launches are appended to ``launches`` as
    (function, args, kwargs) and not run."""
    original = kernel_build.for_device
    kernel_build.for_device = lambda module, device: _Recorder(
        kernel_build.compiled(module), launches
    )
    try:
        yield
    finally:
        kernel_build.for_device = original


def capture(case: Case) -> list[tuple]:
    """The launches (function, args, kwargs) of one forward and backward of ``case``, with the
    inputs in Megatron's [seq, batch, heads, dim] layout; nothing runs."""
    from megatron_abft.faults import TensorFault
    from megatron_abft.flash import FlashFault, FlashLedger, flash_attention
    from megatron_abft.flash.launch import Checks, Findings

    dtype = case.torch_dtype

    def tensor(heads: int) -> torch.Tensor:
        x = torch.empty(case.seq, case.batch, heads, case.head_dim, dtype=dtype)
        return x.permute(1, 2, 0, 3)

    q, k, v = tensor(case.heads), tensor(case.kv_heads), tensor(case.kv_heads)
    do = tensor(case.heads)
    launches: list = []
    with recording(launches):
        if case.variant == "calibrate":
            checks = Checks((1 << len(FLASH_SECTIONS)) - 1, 2.0**-24, 1e10)
            found = Findings.empty(case.batch * case.heads, q.device, calibrate=True)
            ledger = FlashLedger.on(q.device).tensors
            o, lse = launch.forward(q, k, v, case.causal, 0.125, checks, found, ledger)
            launch.backward(do, q, k, v, o, lse, case.causal, 0.125, checks, found, ledger)
            return launches
        options: dict = {"causal": case.causal, "ledger": FlashLedger.on(q.device)}
        if case.variant == "unchecked":
            options["sections"] = ()
        elif case.variant == "inject":
            fault = TensorFault("nan", position=(0, 0), batch_index=0)
            options["faults"] = [FlashFault("scores", fault), FlashFault("grad_q", fault)]
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        flash_attention(*leaves, **options).backward(do)
    return launches


def specialize(fn, args: tuple, kwargs: dict, arch: int = 90) -> Launch:
    """A recorded launch as Triton's launcher specialises it for ``sm_<arch>``."""
    backend, binder, kwargs = _binder(fn, kwargs, arch)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constants, attrs = fn._pack_args(
        backend, kwargs, bound, specialization, options
    )
    named = {name: kwargs[name] for name in kwargs if name in fn.arg_names}
    named.update(num_warps=options.num_warps, num_stages=options.num_stages)
    for (i,), value in constants.items():  # the launcher's constants: GROUP == 1, strides 1
        named.setdefault(fn.arg_names[i], value)
    return Launch(
        fn.fn.__module__,
        fn.fn.__name__,
        tuple(signature.items()),
        tuple(sorted(constants.items(), key=str)),
        tuple(sorted(((k, tuple(map(tuple, v))) for k, v in attrs.items()), key=str)),
        tuple(sorted((k, _hashable(v)) for k, v in options.__dict__.items())),
        tuple(sorted(named.items(), key=str)),
    )


def binder_seconds(recorded: list[tuple], arch: int = 90, repeats: int = 50) -> float:
    """Triton's binder alone on ``recorded`` launches (``recording``'s records), summed: what
    its launcher does on every launch before the cache and the driver (the arguments bound,
    their specialisation computed: a cost that grows with the arguments), the median of
    ``repeats`` runs a launch, in seconds."""
    total = 0.0
    for fn, args, kwargs in recorded:
        _, binder, kwargs = _binder(fn, kwargs, arch)
        times = []
        for _ in range(repeats):
            begin = time.perf_counter()
            binder(*args, **kwargs)
            times.append(time.perf_counter() - begin)
        total += sorted(times)[repeats // 2]
    return total


def global_checks_seconds(recorded: list[tuple], repeats: int = 50) -> float:
    """Triton's launcher's check, at every launch, that each constexpr global a kernel read is
    unchanged since it was hashed (JITFunction.run, one comparison a global; build.compiled
    leaves it nothing to compare), on ``recorded`` launches, summed: the median of ``repeats``
    runs a launch, in seconds."""
    total = 0.0
    for fn, _, _ in recorded:
        fn.cache_key  # noqa: B018  made before the first launch, and the globals with it
        times = []
        for _ in range(repeats):
            begin = time.perf_counter()
            for (name, _), (value, scope) in fn.used_global_vals.items():
                if scope.get(name) != value:
                    raise RuntimeError(f"{fn.fn.__name__}: global {name} changed")
            times.append(time.perf_counter() - begin)
        total += sorted(times)[repeats // 2]
    return total


def _binder(fn, kwargs: dict, arch: int) -> tuple:
    """The backend for ``sm_<arch>``, Triton's binder of ``fn`` for it, and a recorded launch's
    ``kwargs`` with TMA where the architecture has it (as launch.tma decides on a GPU)."""
    if "TMA" in kwargs:
        kwargs = {**kwargs, "TMA": arch >= 90}
    backend = make_backend(GPUTarget("cuda", arch, 32))
    return backend, create_function_from_signature(fn.signature, fn.params, backend), kwargs


def _hashable(value):
    if isinstance(value, list | tuple):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    return value


def launches(cases: list[Case], arch: int = 90) -> list[tuple[Case, Launch]]:
    """Every distinct launch of ``cases`` on ``sm_<arch>`` (the first case that makes one
    names it)."""
    seen: dict[tuple, tuple[Case, Launch]] = {}
    for case in cases:
        for fn, args, kwargs in capture(case):
            made = specialize(fn, args, kwargs, arch)
            seen.setdefault(made.key, (case, made))
    return list(seen.values())


@dataclass(frozen=True)
class Build:
    """One launch built for one architecture: what it uses, and, for an attention kernel on
    sm_90, its main loop."""

    case: Case
    launch: Launch
    arch: int
    shared: int
    """Shared memory, bytes."""
    registers: int
    """Per thread."""
    stack: int
    """Per-thread stack frame, bytes: spilled registers live there."""
    spills: int
    """Bytes of spill stores."""
    warnings: tuple[str, ...]
    """ptxas's warnings (C7510, C7515...)."""
    ctas_per_sm: int
    seconds: float
    loop: sass.LoopMetrics | None = None
    """An attention kernel's interior main loop (sm_90)."""
    extra: dict = field(default_factory=dict)
    """For a helper on sm_90, ``loops``: its innermost loops' (instructions, barriers), in
    address order."""

    @property
    def kernel(self) -> str:
        return self.launch.kernel

    @property
    def problems(self) -> list[str]:
        """What fails the gate for any build: shared memory over the limit, spills."""
        found = []
        if self.shared > ARCHS[self.arch]:
            found.append(f"shared memory {self.shared} B > {ARCHS[self.arch]} B")
        if self.stack or self.spills:
            found.append(f"spills: stack {self.stack} B, spill stores {self.spills} B")
        return found

    def as_dict(self) -> dict:
        made = asdict(self)
        made["launch"] = {"kernel": self.kernel, **dict(self.launch.named)}
        made["problems"] = self.problems
        return made


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def ptxas_report(ptx: str, arch: int) -> tuple[int, int, int, tuple[str, ...]]:
    """What ptxas says of ``ptx`` built for ``sm_<arch>``: registers a thread, stack frame and
    spill stores (bytes), and its performance warnings (C7510, C7515...)."""
    gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        log = subprocess.run(
            [_tool("ptxas"), "-lineinfo", "-v", f"--gpu-name={gpu}", f.name, "-o", os.devnull],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    return (
        int(re.search(r"Used (\d+) registers", log).group(1)),
        int(re.search(r"(\d+) bytes stack frame", log).group(1)),
        int(re.search(r"(\d+) bytes spill stores", log).group(1)),
        tuple(sorted(set(re.findall(r"\b(C75\d\d)\b", log)))),
    )


def compile_made(made: Launch, arch: int):
    """Triton's build of ``made`` for ``sm_<arch>`` (its PTX, cubin and metadata)."""
    fn = getattr(importlib.import_module(made.module), made.name)
    return triton.compile(
        ASTSource(fn, dict(made.signature), dict(made.constants), dict(made.attrs)),
        target=GPUTarget("cuda", arch, 32),
        options=dict(made.options),
    )


def disassemble(compiled) -> list[sass.Instruction]:
    """The SASS of a build (compile_made), by the cuobjdump that ships with Triton."""
    return sass.disassemble(compiled.asm["cubin"], _tool("cuobjdump"))


def compile_launch(case: Case, made: Launch, arch: int) -> Build:
    """Build ``made`` for ``sm_<arch>`` and read what it uses."""
    start = time.perf_counter()
    compiled = compile_made(made, arch)
    registers, stack, spills, warnings = ptxas_report(compiled.asm["ptx"], arch)
    warps = made.get("num_warps")
    shared = compiled.metadata.shared
    loop, extra = None, {}
    if arch == 90:
        instructions = disassemble(compiled)
        found = sass.main_loop(instructions) if made.kernel in tiles.KERNELS else None
        if found is not None:
            loop = sass.LoopMetrics.of(found, 32 * warps, made.get("BLOCK_M") * made.get("BLOCK_N"))
        elif made.kernel not in tiles.KERNELS:  # a helper: its loops' instructions and barriers
            extra["loops"] = [
                (len(x.body), x.count("BAR")) for x in sass.innermost(sass.loops(instructions))
            ]
    return Build(
        case,
        made,
        arch,
        shared,
        registers,
        stack,
        spills,
        warnings,
        sass.ctas_per_sm(registers, shared, warps, arch),
        round(time.perf_counter() - start, 2),
        loop,
        extra,
    )


def _compile(job: tuple[Case, Launch, int]) -> Build:
    return compile_launch(*job)


def build_all(jobs: list[tuple[Case, Launch, int]], workers: int = 0) -> list[Build]:
    """Build every (case, launch, arch), ``workers`` processes at once (0: one a CPU)."""
    workers = workers or os.cpu_count() or 1
    if workers == 1:
        return [_compile(job) for job in jobs]
    with ProcessPoolExecutor(workers) as pool:
        return list(pool.map(_compile, jobs))


def production_cases(**shape) -> list[Case]:
    """The calls the gate holds to its budgets: every GPU dtype, head width and mask, checked
    and unchecked."""
    return [
        Case(str(dtype).removeprefix("torch."), width, causal, variant, **shape)
        for dtype in tiles.GPU_DTYPES
        for width in tiles.HEAD_DIMS
        for causal in (False, True)
        for variant in ("checked", "unchecked")
    ]


def running_launches(dtypes: tuple[str, ...] | None = None) -> list[tuple[Case, Launch]]:
    """The launches that add up a head's column sums (checksums._prefix_sums: the running sums)
    in the production checked calls, on sm_90, of ``dtypes`` (default: every GPU dtype)."""
    cases = [
        c
        for c in production_cases()
        if c.variant == "checked" and (dtypes is None or c.dtype in dtypes)
    ]
    return [
        (case, made)
        for case, made in launches(cases)
        if made.kernel in ("sums", "backward") and made.get("COLUMNS")
    ]


def other_cases() -> list[Case]:
    """Calls that must build (no spill budget for injection and calibration): fault injection
    and calibration, grouped-query attention, ragged lengths and a padded head dim."""
    cases = [
        Case(str(dtype).removeprefix("torch."), width, causal, variant)
        for dtype in tiles.GPU_DTYPES
        for width in tiles.HEAD_DIMS
        for causal in (False, True)
        for variant in ("inject", "calibrate")
    ]
    cases += [
        Case("bfloat16", width, True, variant, seq=1000, kv_heads=4)
        for width in tiles.HEAD_DIMS
        for variant in ("checked", "unchecked")
    ]
    cases += [Case("bfloat16", 80, True, "checked", seq=513)]
    return cases


def name(build: Build) -> str:
    """``kernel hd64 bfloat16 causal checked sm_90``: one build, for messages and tables."""
    case = build.case
    mask = "causal" if case.causal else "full"
    retry = " retry" if build.launch.get("RETRY") else ""
    return (
        f"{build.kernel} hd{case.head_dim} {case.dtype} {mask} {case.variant}{retry} "
        f"sm_{build.arch}"
    )


def verdicts(builds: list[Build]) -> list[str]:
    """What fails the gate, one line each: for every build, shared memory over the device's
    limit; wgmma serialised (ptxas C7510/C7515) but where faults are injected; spills, for the
    launches that run every step (checked or not, sm_90, first launch: the second runs only
    for a flagged block, fault injection and calibration may spill, and sm_80 has no tiles of
    its own yet: they must build); for the production attention
    kernels on sm_90 (first launch, checked and unchecked), a main loop whose GEMMs are not all
    wgmma, issue slots per element of S above tiles.BUDGETS, and checks that add more slots or
    registers than their budget, or cost CTAs per SM."""
    hot = [  # the launches that run every step: checked or not, sm_90, first launch
        b
        for b in builds
        if b.case.variant in ("checked", "unchecked") and b.arch >= 90 and not b.launch.get("RETRY")
    ]
    found = [f"{name(b)}: {p}" for b in builds for p in b.problems if "shared" in p]
    found += [f"{name(b)}: {p}" for b in hot for p in b.problems if "shared" not in p]
    found += [
        f"{name(b)}: ptxas {w}"
        for b in builds
        if b.case.variant != "inject"  # its corrupted accumulators serialise it
        for w in b.warnings
        if w in ("C7510", "C7515")
    ]
    production = {
        (b.kernel, b.case.head_dim, b.case.dtype, b.case.causal, b.case.variant): b
        for b in builds
        if b.arch == 90
        and b.kernel in tiles.KERNELS
        and b.case.variant in ("checked", "unchecked")
        and not b.launch.get("RETRY")
        and b.case.head_dim in tiles.HEAD_DIMS
    }
    for (kernel, width, dtype, causal, variant), b in production.items():
        budget = tiles.BUDGETS[kernel, width]
        if b.loop is None:
            found.append(f"{name(b)}: no main loop with an MMA in its SASS")
            continue
        for opcode in b.loop.non_wgmma():
            found.append(f"{name(b)}: main-loop GEMM {opcode} is not a wgmma of N >= 16")
        if variant == "unchecked" and b.loop.slots_per_element > budget.slots:
            found.append(
                f"{name(b)}: {b.loop.slots_per_element} issue slots per element of S, budget "
                f"{budget.slots}"
            )
        plain = production.get((kernel, width, dtype, causal, "unchecked"))
        if variant != "checked" or plain is None or plain.loop is None:
            continue
        extra = round(b.loop.slots_per_element - plain.loop.slots_per_element, 2)
        if extra > budget.checked:
            found.append(
                f"{name(b)}: the checks add {extra} slots per element, budget {budget.checked}"
            )
        if b.registers > plain.registers + budget.registers:
            found.append(
                f"{name(b)}: {b.registers} registers, {plain.registers} unchecked "
                f"(+{budget.registers} allowed)"
            )
        if b.ctas_per_sm < plain.ctas_per_sm:
            found.append(f"{name(b)}: {b.ctas_per_sm} CTAs per SM, {plain.ctas_per_sm} unchecked")
    return found
