"""The flash kernels' static speed gate (megatron_abft.dev.aot, megatron_abft.dev.sass): every
production kernel built for sm_90 on this CPU machine as the launcher specialises it, its SASS
read. None spills or has ptxas serialise its wgmma; every GEMM of its main loop is a wgmma; its
issue slots per element of S, and what the checks add to them and to its registers, stay within
tiles.BUDGETS; the checks cost no CTA per SM. What else the flash path launches builds too: the
second (RETRY) launches, fault injection and calibration, grouped-query attention with ragged
lengths, a padded head dim, and sm_80. The builds run two at a time: about three minutes on the
2-core CI machine with Triton's cache cold. And where the launch path steps around Triton's own
machinery: a second launch bound as Triton's binder binds it, and the interpreter's patches."""

import inspect

import pytest
import torch
from triton.compiler.compiler import CompiledKernel

from megatron_abft.dev import aot, sass
from megatron_abft.flash import launch, tiles

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT, gsb0 ;
        /*0020*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0030*/                   FADD R2, R24, R25 ;
        /*0040*/                   SHFL.BFLY PT, R3, R2, 0x1, 0x1f ;
        /*0050*/                   HGMMA.64x16x16.F32.BF16 R40, gdesc[UR8], RZ, !UPT, gsb0 ;
        /*0060*/              @!P0 BRA 0x10 ;
        /*0070*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0080*/              @!P1 BRA 0x70 ;
        /*0090*/                   EXIT ;
"""


def test_the_sass_reader_finds_the_main_loop_and_counts_it():
    instructions = sass.parse(SASS)
    assert [i.base for i in instructions][:3] == ["MOV", "HGMMA", "WARPGROUP"]
    loop = sass.main_loop(instructions)
    assert (loop.start, loop.end) == (0x10, 0x60)  # the loop with the most MMAs
    metrics = sass.LoopMetrics.of(loop, threads=256, elements=128 * 64)
    assert metrics.instructions == 6 and metrics.slots_per_element == 0.19
    assert (metrics.shuffles, metrics.wgmma_waits) == (1, 1)
    assert metrics.mma == {"HGMMA.64x64x16.F32.BF16": 1, "HGMMA.64x16x16.F32.BF16": 1}
    assert metrics.non_wgmma() == []
    hmma = sass.LoopMetrics.of(sass.loops(instructions)[1], 32, 16 * 8)
    assert hmma.non_wgmma() == ["HMMA.16816.F32.BF16"]
    # 168 registers: 168 * 32 = 5376 a warp, 8 warps -> 43008 of 65536 registers: one CTA
    assert sass.ctas_per_sm(168, 0, 8, 90) == 1 and sass.ctas_per_sm(128, 0, 8, 90) == 2
    assert sass.ctas_per_sm(64, 120_000, 4, 90) == 1  # shared memory bounds it


def test_the_launches_are_specialised_as_the_launcher_does():
    """Multi-head attention makes GROUP a constant 1, lengths divisible by 16 get Triton's
    divisibility attribute, pointers their 16-byte alignment."""
    case = aot.Case("bfloat16", 64, True, "checked", seq=256)
    made = {m.name: m for _, m in aot.launches([case])}
    forward = made["_fwd_kernel"]
    assert (
        forward.get("GROUP") == 1 and forward.get("BLOCK_M") == tiles.TILES["forward", 64].block_m
    )
    names = forward.signature
    attrs = dict(forward.attrs)
    index = [n for n, _ in names].index("N_Q")
    assert attrs[(index,)] == (("tt.divisibility", 16),)
    assert {"_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel", "_backward_kernel"} <= set(made)
    ragged = {m.name: m for _, m in aot.launches([aot.Case("bfloat16", 64, True, seq=1000)])}
    index = [n for n, _ in ragged["_fwd_kernel"].signature].index("N_Q")
    assert ("tt.divisibility", 16) not in dict(ragged["_fwd_kernel"].attrs).get((index,), ())


@pytest.mark.parametrize("case", [aot.Case("bfloat16", 64, True), aot.Case("float16", 128, False)])
def test_a_second_launch_is_bound_as_the_first_and_as_tritons_binder_binds_it(case):
    """launch._twice hands a RETRY launch to the first launch's twin compiled kernel, without
    Triton's binder: every second launch of a checked call takes its first's specialisation
    (the same arguments, so the same key but for RETRY and RECORD), and bound_arguments gives
    the compiled kernel what the binder would (sm_90)."""
    recorded = aot.capture(case)
    seconds = [i for i, (_, _, kwargs) in enumerate(recorded) if kwargs.get("RETRY")]
    assert len(seconds) == 3  # forward, dK/dV, dQ
    for i in seconds:
        fn, args, kwargs = recorded[i]
        first_fn, first_args, first_kwargs = recorded[i - 1]
        assert first_fn is fn and first_args == args and not first_kwargs["RETRY"]
        _, binder, kwargs = aot._binder(fn, kwargs, 90)
        _, _, first_kwargs = aot._binder(fn, first_kwargs, 90)
        bound, specialization, options = binder(*args, **kwargs)
        _, first_specialization, first_options = binder(*args, **first_kwargs)
        assert options == first_options
        differ = {
            fn.arg_names[j]
            for j, (a, b) in enumerate(zip(specialization, first_specialization, strict=True))
            if a != b
        }
        assert differ <= {"RETRY", "RECORD"} and "RETRY" in differ
        mine = launch.bound_arguments(fn, args, kwargs)
        assert len(mine) == len(bound)
        assert all(a is b or a == b for a, b in zip(mine, bound.values(), strict=True))


class _Compiled(CompiledKernel):
    """A compiled kernel that records its direct launches."""

    def __init__(self, constants: tuple, launched: list) -> None:  # no build: nothing to load
        self.constants, self.launched = constants, launched

    def __getitem__(self, grid):
        return lambda *args: self.launched.append(("direct", grid, args))


class _Kernel:
    """A JIT function's launch as _twice uses it: its launcher records the call and returns the
    compiled kernel of its constexprs (one a key, as Triton's cache keeps them)."""

    def __init__(self) -> None:
        self.launched, self.cache = [], {}
        self.signature = inspect.signature(lambda x, n, BLOCK, RETRY, RECORD: None)

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.launched.append(("launcher", grid, kwargs["RETRY"], kwargs["RECORD"]))
            key = (kwargs["BLOCK"], kwargs["RETRY"], kwargs["RECORD"])
            return self.cache.setdefault(key, _Compiled(key, self.launched))

        return run


def test_a_second_launch_goes_straight_to_its_compiled_kernel_once_known(monkeypatch):
    monkeypatch.setattr(launch, "RETRIES", {})
    kernel, x = _Kernel(), torch.zeros(1)
    checked = dict(BLOCK=64, DUE=1, TMA=False, num_warps=4)
    launch._twice(kernel, (2, 1), x, 7, record=True, **checked)  # both through the launcher
    assert kernel.launched == [("launcher", (2, 1), False, False), ("launcher", (2, 1), True, True)]
    kernel.launched.clear()
    launch._twice(kernel, (3, 1), x, 7, record=True, **checked)
    assert kernel.launched == [
        ("launcher", (3, 1), False, False),
        ("direct", (3, 1), (x, 7, 64, True, True)),  # the parameters in order, no options
    ]
    kernel.launched.clear()
    launch._twice(kernel, (3, 1), x, 7, record=False, **checked)  # RECORD's twin: launcher
    assert kernel.launched[1] == ("launcher", (3, 1), True, False)
    kernel.launched.clear()
    launch._twice(kernel, (3, 1), x, 7, record=True, **{**checked, "DUE": 0})
    assert kernel.launched == [("launcher", (3, 1), False, False)]  # nothing checked, no retry


def test_every_production_kernel_is_within_its_budget():
    jobs = [
        (case, made, 90)
        for case, made in aot.launches(aot.production_cases())
        if made.kernel in tiles.KERNELS and not made.get("RETRY")
    ]
    assert len(jobs) == len(tiles.KERNELS) * len(tiles.HEAD_DIMS) * 2 * 2 * 2
    builds = aot.build_all(jobs, workers=2)
    assert aot.verdicts(builds) == []
    for b in builds:
        assert b.loop is not None and b.loop.mma, aot.name(b)


def test_what_else_the_flash_path_launches_builds():
    """Every launch (the second ones and the helpers included) of fault injection and
    calibration (which may spill), grouped-query attention with ragged lengths at either head
    dim (one of them padded), the production kernels for sm_80 (A100) and the unchecked call's
    Delta launch, which must build.
    Each case carries several of these, so that CI builds each kind of specialisation once."""
    cases = [
        aot.Case("bfloat16", 64, True, "inject", seq=1000, kv_heads=4),
        aot.Case("bfloat16", 64, True, "calibrate"),
        aot.Case("bfloat16", 80, True, seq=513, kv_heads=4),
    ]
    jobs = [(case, made, 90) for case, made in aot.launches(cases)]
    jobs += [
        (case, made, 80)
        for case, made in aot.launches([aot.Case("bfloat16", 64, True)], 80)
        if made.kernel in tiles.KERNELS and not made.get("RETRY")
    ]
    unchecked = aot.launches([aot.Case("bfloat16", 64, True, "unchecked")])
    jobs += [(case, made, 90) for case, made in unchecked if made.kernel not in tiles.KERNELS]
    builds = aot.build_all(jobs, workers=2)
    assert {b.kernel for b in builds} >= {*tiles.KERNELS, "backward", "sums", "delta"}
    assert any(b.launch.get("RETRY") for b in builds) and any(b.arch == 80 for b in builds)
    assert aot.verdicts(builds) == []


def test_the_running_sums_build_without_a_spill():
    """The launches that add up a head's column sums (a program a head, a scan of
    checksums.SCAN values a step) at every production dtype and head dim: no spill, no shared
    memory over the limit; their loops are read (tools/flash_sass.py --running tabulates
    them)."""
    jobs = [(case, made, 90) for case, made in aot.running_launches()]
    assert len(jobs) == 2 * len(tiles.GPU_DTYPES) * len(tiles.HEAD_DIMS)
    builds = aot.build_all(jobs, workers=2)
    assert aot.verdicts(builds) == []
    for b in builds:
        assert b.extra["loops"] and b.extra["loops"][0][0] > 0, aot.name(b)


def test_interpreted_launches_leave_the_compiler_as_they_found_it():
    """A process that interprets the kernels (CPU tensors) compiles them after (CUDA tensors):
    the interpreter's patches of triton.language, its core included, are undone."""
    import triton.language as tl

    from megatron_abft.flash import flash_attention

    before = {name: getattr(tl.core, name) for name in ("cast", "dot", "where", "reduce")}
    made = (tl.core.tuple, tl.core.tuple_type, tl.core.block_type)
    constructors = [vars(cls)["__init__"] for cls in made]
    q = torch.randn(1, 1, 24, 64, dtype=torch.bfloat16)
    flash_attention(q, q, q)
    assert {name: getattr(tl.core, name) for name in before} == before
    assert [vars(cls)["__init__"] for cls in made] == constructors  # Triton's own, not lazy
    case, sums = next(
        (c, m)
        for c, m in aot.launches([aot.Case("bfloat16", 64, True, seq=64)])
        if m.kernel == "sums"
    )
    assert aot.compile_launch(case, sums, 90).registers > 0


def test_the_interpreters_numpy_types_are_its_own():
    """The interpreter's numpy type of a Triton type, answered from a table made once
    (build._patch_interpreter): the interpreter's own answer for every scalar type, block of it
    and pointer to it."""
    import triton.language as tl
    from triton.runtime import interpreter

    from megatron_abft.flash import build, kernels

    build.interpreted(kernels)  # the interpreter's patches made
    numpy_type = interpreter._get_np_dtype
    own = numpy_type.original
    scalars = [
        t
        for t in vars(tl.core).values()
        if isinstance(t, tl.dtype) and not isinstance(t, tl.pointer_type | tl.block_type)
    ]
    answered = 0
    for t in scalars:
        for of in (t, tl.block_type(t, [2, 4]), tl.pointer_type(t)):
            try:
                want = own(of)
            except KeyError:
                continue
            assert numpy_type(of) == want, of
            answered += 1
    assert answered >= 3 * 13  # the integer and float types, blocks of them, pointers to them


def test_the_interpreters_types_are_tritons_but_for_when_their_names_are_made():
    """Within an interpreted launch, tuples, tuple types and block types are made by
    build._lazy_types' constructors, which leave their names and a tuple's type to be made when
    read: what is read equals what Triton's own constructors make."""
    import triton.language as tl

    from megatron_abft.flash import build

    core = tl.core
    cases = {
        core.tuple_type: [([tl.int32, tl.float32],), ([tl.int32, tl.float32], ["a", "b"])],
        core.block_type: [(tl.bfloat16, [2, 64]), (tl.float32, core.tuple([16]))],
        core.tuple: [([tl.constexpr(2), tl.constexpr(8)],), ([1, 2], [tl.int32, tl.int32])],
    }
    for cls, make in build._lazy_types(core):
        for args in cases.pop(cls):
            own, lazy = cls(*args), cls.__new__(cls)
            make(lazy, *args)
            if cls is core.tuple:
                assert lazy.values == own.values and lazy.type == own.type
                assert lazy.type.name == own.type.name and lazy.type.fields == own.type.fields
            else:
                assert lazy == own and lazy.name == own.name and str(lazy) == str(own)
            if cls is core.block_type:
                assert lazy.numel == own.numel and list(lazy.shape) == list(own.shape)
    assert not cases  # every type the launches make lazily is compared
    with pytest.raises(TypeError, match="0d block_type"):
        dict(build._lazy_types(core))[core.block_type](
            core.block_type.__new__(core.block_type), tl.float32, []
        )


@pytest.mark.parametrize("kernel", tiles.KERNELS)
def test_the_tiles_are_those_the_launches_take(kernel):
    for width in tiles.HEAD_DIMS:
        tile = tiles.TILES[kernel, width]
        assert launch.blocks(kernel, width, torch.bfloat16) == tile
        assert launch.blocks(kernel, width, torch.float16) == tile
        held, streamed = (
            (tile.block_n, tile.block_m) if kernel == "dkdv" else (tile.block_m, tile.block_n)
        )
        assert held % streamed == 0  # the causal diagonal is whole tiles
    assert launch.blocks(kernel, 64, torch.float32) == tiles.INTERPRETED
    with pytest.raises(ValueError, match="unknown flash kernel 'fwd'"):
        launch.blocks("fwd", 64, torch.bfloat16)


def test_the_library_never_imports_the_gate_machinery():
    """megatron_abft.dev (the builds that shell out to ptxas and cuobjdump) is the developers':
    no module of the library outside it imports it."""
    import ast
    from pathlib import Path

    package = Path(aot.__file__).parents[1]
    importers = []
    for path in package.rglob("*.py"):
        if path.parent.name == "dev":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            if any(n == "megatron_abft.dev" or n.startswith("megatron_abft.dev.") for n in names):
                importers.append(str(path.relative_to(package)))
    assert importers == []
    assert len(list(package.rglob("*.py"))) > 40  # the walk saw the package


def test_on_a_gpu_the_tuning_files_tiles_for_its_name_and_tma_from_its_capability(
    monkeypatch, tmp_path
):
    """launch.blocks takes the tuning file's tile for bf16 on the GPU of that name (fp16 keeps
    the gate's), launch.tma the TMA loads from compute capability 9; each GPU's name and
    capability are asked once (a flash call needs them six times)."""
    import json

    asked = []
    names = {0: "NVIDIA H200", 1: "NVIDIA A100-SXM4-80GB"}
    majors = {0: 9, 1: 8}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: asked.append(i) or names[i])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (majors[i], 0))
    tuned = tiles.Blocks(64, 64, 4, 2)
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps({"NVIDIA H200": {"forward/64": [64, 64, 4, 2]}}))
    monkeypatch.setenv("ABFT_FLASH_TILES", str(path))
    launch.tuned.cache_clear()
    launch._asked.cache_clear()
    try:
        h200, a100 = torch.device("cuda", 0), torch.device("cuda", 1)
        for _ in range(3):
            assert launch.blocks("forward", 64, torch.bfloat16, h200) == tuned
            assert launch.blocks("forward", 64, torch.float16, h200) == tiles.TILES["forward", 64]
            assert launch.blocks("forward", 64, torch.bfloat16, a100) == tiles.TILES["forward", 64]
            assert launch.tma(h200) and not launch.tma(a100)
        assert sorted(asked) == [0, 1]
    finally:
        launch.tuned.cache_clear()
        launch._asked.cache_clear()
