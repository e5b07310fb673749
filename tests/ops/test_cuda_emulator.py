"""The CUDA emulator (csrc/emulator/cuda_emulator.h): what it runs and what it catches, on probe
kernels built here with the C++ compiler; and the extension's CUDA kernels run through it
(megatron_abft.ops.compiled.emulated_cuda)."""

import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cuda_targets import emulator_built

from megatron_abft.ops import compiled

ROOT = Path(__file__).resolve().parents[2]
needs_emulator = pytest.mark.skipif(not emulator_built(), reason="no CUDA emulator in this build")


@pytest.fixture(scope="module")
def probes(tmp_path_factory) -> dict[str, tuple[int, str]]:
    """The probe kernels' lines, by name: (error code, result or the emulator's message)."""
    if not (sys.platform.startswith("linux") and platform.machine() == "x86_64"):
        pytest.skip("the CUDA emulator is built for x86-64 Linux")
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    binary = tmp_path_factory.mktemp("probe") / "probe"
    sources = [ROOT / "tests/ops/cuda_emulator_probe.cpp", ROOT / "csrc/emulator/cuda_emulator.cpp"]
    subprocess.run(
        [compiler, "-std=c++17", "-O1", f"-I{ROOT / 'csrc'}", *map(str, sources), "-o", binary],
        check=True,
        capture_output=True,
    )
    lines = subprocess.run([binary], check=True, capture_output=True, text=True).stdout
    found = {}
    for line in lines.splitlines():
        name, rest = line.split(": ", 1)
        code, _, text = rest.partition(" ")
        found[name] = (int(code), text)
    return found


def test_a_warp_and_block_reduction_runs_alike_in_every_schedule(probes):
    want = " ".join(str(sum(i % 7 for i in range(256 * b, 256 * (b + 1)))) for b in range(4))
    for schedule in (0, 1, 12345):
        assert probes[f"block_sum schedule {schedule}"] == (0, want)


@pytest.mark.parametrize(
    "probe, code, message",
    [
        ("divergent_barriers", 1, r"__syncthreads at lines \d+ and \d+"),
        ("exit_before_barrier", 1, "thread 3 of block 0 exited before the __syncthreads"),
        ("split_warp", 1, "wait at barriers that can never complete"),
        ("partial_warp", 1, "warp 1 has 16 lanes; a full-mask shuffle needs 32"),
        ("divergent_syncwarp", 1, r"warp 0 meets at lines \d+ and \d+"),
        ("empty_grid", 9, "launch of 0x1x1 blocks"),
        ("too_many_threads", 9, "blocks of 2048 threads"),
        ("shared_over_48k", 1, "65536 bytes of dynamic shared memory; the kernel allows 49152"),
    ],
)
def test_it_reports_what_a_gpu_would_leave_undefined(probes, probe, code, message):
    got_code, text = probes[probe]
    assert got_code == code and re.search(message, text), (probe, got_code, text)


def test_dynamic_shared_memory_is_poisoned_until_written(probes):
    assert probes["shared_allowed"] == (0, "ffffffff")


def test_schedules_expose_order_dependent_races_and_leave_atomics_alone(probes):
    assert probes["blocks_race forward"] == (0, "7") and probes["blocks_race reversed"] == (0, "0")
    assert probes["threads_race forward"][1] != probes["threads_race reversed"][1]
    # a __syncwarp orders a warp's shared memory: lane i reads what lane i + 1 wrote
    assert probes["warp_synced forward"] == probes["warp_synced reversed"] == (0, "1 0")
    total = str(sum(range(64)))
    assert probes["atomic_count forward"] == probes["atomic_count reversed"] == (0, total)


@needs_emulator
def test_emulation_routes_the_cpu_ops_to_the_cuda_kernels():
    """The CUDA products kernel sums a row a lane at a time and then across the warp, the C++
    one in its own order: on the same values, other roundings."""
    g = torch.Generator().manual_seed(0)
    a, u = torch.randn(2, 40, 4096, generator=g), torch.randn(2, 3, 4096, generator=g)
    on_cpu = torch.ops.megatron_abft.row_products(a, u, u.abs())[0]
    with compiled.emulated_cuda():
        assert compiled.backend().startswith("cuda (emulated")
        emulated = torch.ops.megatron_abft.row_products(a, u, u.abs())[0]
    assert compiled.backend() == "cpu" or not torch.cuda.is_available()
    assert not torch.equal(emulated, on_cpu)
    torch.testing.assert_close(emulated, on_cpu, rtol=1e-5, atol=1e-3)
    # after the block, _C's own kernel again
    assert torch.equal(torch.ops.megatron_abft.row_products(a, u, u.abs())[0], on_cpu)


@needs_emulator
def test_emulation_nests_and_restores_the_schedule():
    with compiled.emulated_cuda(schedule=5):
        with compiled.emulated_cuda(schedule=1):
            assert compiled._emulating
        assert compiled._emulating
    assert not compiled._emulating
    emulator = compiled._load_emulator()[0]
    assert emulator.emulate(False, 0) == (False, 0)  # off, and back at schedule 0


@needs_emulator
def test_the_emulator_is_an_extension_of_its_own_that_production_never_imports():
    """The CUDA kernels built for the CPU, and their bindings, live in megatron_abft._emulator:
    _C has nothing of it, and a fresh process that uses the kernels never loads it;
    emulated_cuda does."""
    code = (
        "import sys, torch; from megatron_abft.ops import compiled; "
        "from megatron_abft.check.checksum import encode; "
        "a, b = torch.randn(2, 32, 16), torch.randn(2, 16, 24); encode(a, b, block=16); "
        "assert compiled.available() and 'megatron_abft._emulator' not in sys.modules; "
        "ctx = compiled.emulated_cuda(); ctx.__enter__(); "
        "assert 'megatron_abft._emulator' in sys.modules; ctx.__exit__(None, None, None)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    module = compiled._load()[0]
    assert not [name for name in dir(module) if "emulat" in name]


@needs_emulator
@pytest.mark.parametrize("schedule", [0, 1, 20261125])
def test_the_emulated_cuda_kernels_pass_the_gpu_selftest(schedule):
    """The known-answer test each GPU runs before its kernels are used (every launcher, clean and
    with faults, fp32 and bf16, both single-pass softmax kernels), through the emulator in three
    schedules."""
    from megatron_abft.ops.selftest import mismatches

    with compiled.emulated_cuda(schedule):
        compiled.emulated_launches()
        assert mismatches(torch.device("cpu")) == []
        kernels = {name.split("<")[0] for name in compiled.emulated_launches()}
    assert {"softmax_rows_kernel", "softmax_pass_kernel", "correct_tally_kernel"} <= kernels


def every_launcher() -> dict[str, torch.Tensor]:
    """The outputs of every CUDA launcher on one faulty attention-shaped case, by name: encode
    (encode_pair's paired block sums and products), add_bias, verify_correct_tally (the screened
    block sums, the one-block correction and tally), softmax_correct_tally (the single pass, the
    redo) and softmax_check with rows too long for the single pass (the composed kernels).
    Blocks of 64: tiles of two warps and two chunks of 32 rows, where warps can race."""
    from megatron_abft.check.checksum import encode
    from megatron_abft.check.ledger import Ledger
    from megatron_abft.check.sides import Check, kernel_sides
    from megatron_abft.check.tolerance import gemm_rounding

    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 3, 160, 24, generator=g).bfloat16()
    k = torch.randn(2, 1, 24, 144, generator=g).bfloat16()
    s = q @ k
    s[1, 2, 5, 7] += 1e3
    s[0, 1, :, 3] = float("nan")
    ops = torch.ops.megatron_abft
    col, row = encode(q, k, block=64)
    sums = (col.sums, col.magnitude, row.sums, row.magnitude)
    check = Check(gemm_rounding(torch.bfloat16, s.device), 1.0, 1e10, 0, None)
    sides = kernel_sides(s, {"col": col, "row": row}, check)
    out = dict(zip(("col sums", "col sizes", "row sums", "row sizes"), sums, strict=True))
    bias = torch.randn(144, generator=g).bfloat16()
    for i, t in enumerate(ops.add_bias(*sums, bias, 160, 64)):
        out[f"add_bias {i}"] = t
    ledger, fixed = Ledger.on(s.device, 3), s.clone()
    found = ops.verify_correct_tally(
        fixed, *sides, q, k, 1.0, None, 1e10, 256, *compiled._ledger_args(ledger)
    )
    out["corrected by verify_correct_tally"] = fixed
    out |= {f"verify_correct_tally {i}": t for i, t in enumerate(found)}
    out |= {f"its ledger's {name}": t for name, t in vars(ledger).items()}
    v = torch.randn(2, 3, 144, 16, generator=g).bfloat16()
    u, z = ops.pair_vectors(s, v, 64)
    scores, ledger = s.clone(), Ledger.on(s.device, 3)
    softmax = ops.softmax_correct_tally(
        scores,
        *sides,
        None,
        False,
        1.0,
        64,
        u,
        z,
        q,
        k,
        1.0,
        1e10,
        256,
        *compiled._ledger_args(ledger),
    )
    out["corrected by softmax_correct_tally"] = scores
    out |= {f"softmax_correct_tally {i}": t for i, t in enumerate(softmax)}
    wide = torch.randn(2, 8, 4100, generator=g)
    composed = ops.softmax_check(wide, 0, 0, [], [], [], [], None, False, 1.0, 8, None, None)
    return out | {f"composed softmax_check {i}": t for i, t in enumerate(composed)}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dtype.is_floating_point else t


@needs_emulator
def test_every_launcher_writes_the_same_bits_in_every_schedule():
    """One writer an output and integer atomics only: whatever order the threads and blocks of
    a launch run in, its outputs are the same, bit for bit. A race would show here."""
    outputs = {}
    for schedule in (0, 1, 7, 20261125):
        with compiled.emulated_cuda(schedule):
            outputs[schedule] = every_launcher()
    first = outputs[0]
    # a 0D fault and a NaN column (160 rows: capacity 256), corrected by both ops
    assert first["verify_correct_tally 0"].eq(1).sum() == 2
    assert not first["verify_correct_tally 5"] and not first["softmax_correct_tally 1"]
    assert int(first["its ledger's counts"][1].sum()) == 2
    for schedule, got in outputs.items():
        assert got.keys() == first.keys()
        for name, t in got.items():
            assert t.dtype == first[name].dtype and t.shape == first[name].shape, name
            assert torch.equal(bits(t), bits(first[name])), (schedule, name)
