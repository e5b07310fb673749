"""What the sm_90 SASS of the CUDA checksum kernels (block sums, products) does a row: in the built
extension (megatron_abft/_C*.so, as `make install` builds it), or in another version of
csrc/kernels/abft_cuda.cu built with setup.py's nvcc flags (``--source``), each kernel's
stack frame (spilled registers live there) and innermost loops that read global memory,
with their instructions, shuffles, loads, shared memory accesses and the distance from a load
to its first use. It counts instructions, as the flash kernels' gate does
(megatron_abft.dev.sass); it does not time them.

    python -m tools.checksum_sass [--dtype bf16] [--source PATH]

On the vector path (rows contiguous and aligned) a loop iteration reads four elements of a row a
thread (``LDG.E.64`` in bf16 and fp16, ``LDG.E.128`` in fp32); on the other, each thread walks a
column, an element a load (``LDG.E.U16`` in bf16 and fp16).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import triton

from megatron_abft.dev import sass

ROOT = Path(__file__).resolve().parents[1]
NVCC_FLAGS = ["-O3", "-std=c++17"]
"""setup.py's NVCC_FLAGS, less -lineinfo, which changes no instruction."""
ELEMENTS = {"bf16": "13__nv_bfloat16", "fp16": "6__half", "fp32": "f"}
"""The mangled element type T of each dtype's kernels."""
TYPES = {dtype: element + "f" for dtype, element in ELEMENTS.items()}
"""The mangled template arguments <T, Acc> of each dtype's kernels."""
KINDS = {
    "screened, rows in vectors": "block_sums_kernelI{}Lb1ELb1EE",
    "screened, a column a thread": "block_sums_kernelI{}Lb1ELb0EE",
    "plain, rows in vectors": "block_sums_kernelI{}Lb0ELb1EE",
    "plain, a column a thread": "block_sums_kernelI{}Lb0ELb0EE",
    "paired, rows in vectors": "block_sums_pair_kernelI{}Lb1ELb1EE",
    "paired, a column a thread": "block_sums_pair_kernelI{}Lb0ELb0EE",
    "products, a pass of two": "products_kernelI{}Li2ELi1EE",
    "products, a pass of sixteen": "products_kernelI{}Li16ELi1EE",
    "products, a pass of sixteen, two rows a warp": "products_kernelI{}Li16ELi2EE",
}
"""The block-sums kernels, each on both paths: a verify's (each tile screening what it
completes), the plain one, and an encode's (two operands in one launch); and the products
kernels (row_products), the first two each holding its three ways of reading A (a vector of a
row a load, an entry of a row, an entry of a column), the third a wide pass whose operands are
all read in vectors, two rows a warp."""
SOFTMAX = {
    "rows in registers": "softmax_rows_kernelI{}EE",
    "any rows": "softmax_pass_kernelI{}fEE",
}
"""The fused softmax's single-pass kernels (softmax_check): the one for rows that fit a warp's
registers (a row's passes unrolled over its registers, no loop), and the general one."""
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
"""The disassembler Triton carries, as the flash kernels' gate uses it."""


def extension() -> Path | None:
    """The built CUDA extension, or None."""
    found = sorted((ROOT / "megatron_abft").glob("_C*.so"))
    return found[0] if found else None


def compiled(source: Path) -> Path:
    """``source`` built for sm_90 into a cubin in a temporary folder (nvcc from PATH), with the
    headers of its own checkout (the csrc/ it lies in), as setup.py's include path."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise FileNotFoundError("nvcc is not on PATH: the CUDA toolkit builds the checksum kernels")
    cubin = Path(tempfile.mkdtemp()) / "abft_cuda.cubin"
    headers = source.resolve().parents[1]  # csrc/kernels/abft_cuda.cu -> csrc
    command = [nvcc, *NVCC_FLAGS, f"-I{headers}", "-arch=sm_90", "-cubin", "-o", str(cubin)]
    subprocess.run([*command, str(source)], capture_output=True, text=True, check=True)
    return cubin


def dump(binary: Path, *options: str) -> str:
    command = [str(CUOBJDUMP), *options, "-arch", "sm_90", str(binary)]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


def functions(text: str) -> dict[str, str]:
    """Each function's part of a cuobjdump listing, by its mangled name."""
    parts = re.split(r"\n\s+Function : (\S+)\n", text)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def load_to_use(body: tuple[sass.Instruction, ...]) -> dict[str, int]:
    """By load opcode, the fewest instructions of a loop from a global load to the first one
    that reads what it loaded (around the loop's back edge): where that is a few, each load's
    latency stalls its warp; a load made an iteration ahead of its use has an iteration's work
    between."""
    distances: dict[str, int] = {}
    for at, load in enumerate(body):
        if load.base != "LDG":
            continue
        first = int(re.match(r"R(\d+)", load.operands).group(1))
        words = 4 if load.opcode.endswith(".128") else 2 if load.opcode.endswith(".64") else 1
        loaded = {f"R{first + w}" for w in range(words)}
        distance = len(body)
        for step in range(1, len(body) + 1):
            reader = body[(at + step) % len(body)]
            sources = reader.operands.split(",", 1)[1] if "," in reader.operands else ""
            if loaded & set(re.findall(r"\bR\d+\b", sources)):
                distance = step
                break
        distances[load.opcode] = min(distance, distances.get(load.opcode, distance))
    return distances


def enclosing(loop: sass.Loop, all_loops: list[sass.Loop]) -> sass.Loop | None:
    """The smallest of ``all_loops`` that holds ``loop`` and more, or None."""
    around = [
        other
        for other in all_loops
        if other.start <= loop.start and loop.end <= other.end and len(other.body) > len(loop.body)
    ]
    return min(around, key=lambda other: len(other.body), default=None)


def reading_loops(instructions: list[sass.Instruction]) -> list[dict]:
    """The innermost loops that load global memory: their length, shuffles, loads, shared
    memory accesses (by opcode), local memory accesses (spilled registers), load-to-use
    distance, and the calls (an int64 division is one) of the loop around each."""
    every = sass.loops(instructions)
    found = []
    for loop in sass.innermost(every):
        if not loop.count("LDG"):
            continue
        outer = enclosing(loop, every)
        found.append(
            {
                "instructions": len(loop.body),
                "shuffles": loop.count("SHFL"),
                "loads": [i.opcode for i in loop.body if i.base == "LDG"],
                "shared": dict(Counter(i.opcode for i in loop.body if i.base in ("LDS", "STS"))),
                "local": loop.count("LDL", "STL"),
                "load_to_use": load_to_use(loop.body),
                "calls_around": 0 if outer is None else outer.count("CALL"),
            }
        )
    return found


def report(binary: Path, dtype: str) -> dict[str, dict]:
    """For the block-sums kernels of ``dtype`` in ``binary`` (an extension or a cubin): each
    one's stack frame in bytes and its reading loops."""
    code = functions(dump(binary, "-sass"))
    usage = dump(binary, "--dump-resource-usage")
    stacks = dict(re.findall(r"Function (\S+):\s+REG:\d+ STACK:(\d+)", usage))
    out = {}
    for kind, pattern in KINDS.items():
        tag = pattern.format(TYPES[dtype])
        (name,) = [n for n in code if tag in n]
        out[kind] = {
            "stack_bytes": int(stacks[name]),
            "loops": reading_loops(sass.parse(code[name])),
        }
    return out


def softmax_report(binary: Path, dtype: str) -> dict[str, dict]:
    """For the fused softmax's kernels of ``dtype`` in ``binary``: each one's registers, stack
    frame and reading loops; for the one that holds rows in registers, also its row's code (from
    the barrier that starts a task's rows to the one that ends a group of rows): a straight run
    of branches, no loop but the row's screens, so that its length bounds the instructions a row
    takes, with its exponentials (MUFU.EX2) and global loads and stores by opcode."""
    code = functions(dump(binary, "-sass"))
    usage = dump(binary, "--dump-resource-usage")
    resources = {
        name: (int(registers), int(stack))
        for name, registers, stack in re.findall(r"Function (\S+):\s+REG:(\d+) STACK:(\d+)", usage)
    }
    out = {}
    for kind, pattern in SOFTMAX.items():
        (name,) = [n for n in code if pattern.format(ELEMENTS[dtype]) in n]
        instructions = sass.parse(code[name])
        found = {
            "registers": resources[name][0],
            "stack_bytes": resources[name][1],
            "loops": reading_loops(instructions),
        }
        if kind == "rows in registers":
            barriers = [n for n, i in enumerate(instructions) if i.base == "BAR"]
            row = instructions[barriers[1] + 1 : barriers[2]]
            found["row"] = {
                "instructions": len(row),
                "exponentials": sum(i.opcode == "MUFU.EX2" for i in row),
                "loads": dict(Counter(i.opcode for i in row if i.base == "LDG")),
                "stores": dict(Counter(i.opcode for i in row if i.base == "STG")),
                "local": sum(i.base in ("LDL", "STL") for i in row),
            }
        out[kind] = found
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=TYPES, default="bf16")
    parser.add_argument("--source", type=Path, help="an abft_cuda.cu to build (needs nvcc)")
    args = parser.parse_args(argv)
    binary = compiled(args.source) if args.source else extension()
    if binary is None:
        parser.error("no built extension (make install), and no --source")
    for kind, found in report(binary, args.dtype).items():
        print(f"{kind}: a stack frame of {found['stack_bytes']} bytes")
        for loop in found["loops"]:
            loads = ", ".join(sorted(set(loop["loads"])))
            uses = ", ".join(f"{op} {n}" for op, n in sorted(loop["load_to_use"].items()))
            shared = ", ".join(f"{n} {op}" for op, n in sorted(loop["shared"].items())) or "none"
            print(
                f"  loop of {loop['instructions']} instructions, {loop['shuffles']} shuffles, "
                f"{len(loop['loads'])} loads ({loads}), shared memory {shared}, "
                f"{loop['local']} local accesses; instructions from a load to its use: {uses}"
            )
    for kind, found in softmax_report(binary, args.dtype).items():
        print(
            f"softmax, {kind}: {found['registers']} registers, a stack frame of "
            f"{found['stack_bytes']} bytes"
        )
        if "row" in found:
            row = found["row"]
            loads = ", ".join(f"{n} {op}" for op, n in sorted(row["loads"].items()))
            stores = ", ".join(f"{n} {op}" for op, n in sorted(row["stores"].items()))
            print(
                f"  a row's code: {row['instructions']} instructions, {row['exponentials']} "
                f"exponentials, loads {loads}, stores {stores}, {row['local']} local accesses"
            )
        for loop in found["loops"]:
            loads = ", ".join(f"{n} {op}" for op, n in sorted(Counter(loop["loads"]).items()))
            print(
                f"  loop of {loop['instructions']} instructions, {loop['shuffles']} shuffles, "
                f"loads {loads}, {loop['local']} local accesses"
            )
    return 0
