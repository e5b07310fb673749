"""What a cubin's SASS says about a kernel's main loop: the static speed metrics of the flash
kernels' gate (megatron_abft.dev.aot, tests/flash/test_flash_gate.py).

The disassembly (Triton's bundled cuobjdump) is parsed into instructions with their addresses;
a branch to an earlier address closes a loop. The main loop is an innermost loop that holds
the most MMA instructions; where several do (a causal kernel's masked diagonal loop and its
unmasked interior one, or a checked kernel's second pass), the interior loop is the shortest.
Everything here counts instructions: it ranks kernels, it does not time them.
"""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from dataclasses import dataclass, field

_INSTRUCTION = re.compile(
    r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)\s*([^;]*);"
)
_TARGET = re.compile(r"0x([0-9a-f]+)")
MMA = ("HGMMA", "HMMA")
"""Tensor-core MMA opcodes: Hopper's warpgroup MMA (wgmma) and the warp-level mma.sync."""
ADDRESS_OPS = ("IMAD", "IADD3", "LEA", "SHF", "LOP3", "IABS", "ISETP", "SEL", "IMNMX", "VIADD")
"""Integer and address arithmetic (their uniform-datapath twins, U*, run beside them and are
not counted)."""
REGISTERS_PER_SM = 65536
SHARED_PER_SM = {80: 167936, 90: 233472}
"""Shared memory an SM gives its blocks, in bytes (the per-block limit plus the 1 KiB each
block reserves counts against it)."""
MAX_WARPS_PER_SM = 64


@dataclass(frozen=True)
class Instruction:
    address: int
    opcode: str
    """With its modifiers, e.g. ``HGMMA.64x64x16.F32.BF16``."""
    operands: str

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]


def disassemble(cubin: bytes, cuobjdump: str) -> list[Instruction]:
    """The SASS instructions of the one kernel in ``cubin``."""
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True
        ).stdout
    return parse(text)


def parse(text: str) -> list[Instruction]:
    return [
        Instruction(int(m.group(1), 16), m.group(2), m.group(3).strip())
        for m in _INSTRUCTION.finditer(text)
    ]


@dataclass(frozen=True)
class Loop:
    """Instructions from a backward branch's target to the branch, one iteration."""

    body: tuple[Instruction, ...]

    @property
    def start(self) -> int:
        return self.body[0].address

    @property
    def end(self) -> int:
        return self.body[-1].address

    def count(self, *prefixes: str) -> int:
        return sum(1 for i in self.body if i.opcode.startswith(prefixes))

    @property
    def mma(self) -> Counter:
        """MMA instructions by opcode (shape and types)."""
        return Counter(i.opcode for i in self.body if i.base in MMA)


def loops(instructions: list[Instruction]) -> list[Loop]:
    """Every loop, innermost or not, in address order of its start."""
    at = {ins.address: n for n, ins in enumerate(instructions)}
    found = []
    for n, ins in enumerate(instructions):
        if ins.base != "BRA":
            continue
        target = _TARGET.search(ins.operands)
        if target is None:
            continue
        start = int(target.group(1), 16)
        if start < ins.address and start in at:
            found.append(Loop(tuple(instructions[at[start] : n + 1])))
    return sorted(found, key=lambda loop: loop.start)


def innermost(all_loops: list[Loop]) -> list[Loop]:
    """The loops that hold no other loop."""
    return [
        outer
        for outer in all_loops
        if not any(
            inner is not outer and outer.start <= inner.start and inner.end <= outer.end
            for inner in all_loops
        )
    ]


def main_loop(instructions: list[Instruction]) -> Loop | None:
    """The interior main loop: of the innermost loops holding the most MMA instructions, the
    shortest (None: no loop holds an MMA)."""
    candidates = [loop for loop in innermost(loops(instructions)) if loop.mma]
    if not candidates:
        return None
    most = max(sum(loop.mma.values()) for loop in candidates)
    return min(
        (loop for loop in candidates if sum(loop.mma.values()) == most), key=lambda x: len(x.body)
    )


def ctas_per_sm(registers: int, shared: int, warps: int, arch: int) -> int:
    """Thread blocks an SM holds at once, as registers (allocated 8 a thread, 256 a warp),
    shared memory and warps allow."""
    per_warp = -(-registers * 32 // 256) * 256
    by_registers = REGISTERS_PER_SM // (per_warp * warps)
    by_shared = SHARED_PER_SM[arch] // (shared + 1024) if shared else by_registers
    return max(0, min(by_registers, by_shared, MAX_WARPS_PER_SM // warps))


@dataclass(frozen=True)
class LoopMetrics:
    """The interior main loop of one kernel, per iteration."""

    instructions: int
    slots_per_element: float
    """Issue slots (instructions x threads) per element of the loop's tile of S."""
    mma: dict[str, int]
    barriers: int
    shuffles: int
    wgmma_waits: int
    """``WARPGROUP.DEPBAR``: waits for the warpgroup's outstanding MMAs."""
    async_loads: int
    """``LDGSTS`` (cp.async) and ``UTMALDG`` (TMA) issued."""
    loads: int
    """Plain global loads (``LDG``)."""
    address_ops: int
    exp2: int
    """``MUFU.EX2``."""
    opcodes: dict[str, int] = field(default_factory=dict)
    """Every opcode of the loop (base name) and its count."""

    @classmethod
    def of(cls, loop: Loop, threads: int, elements: int) -> LoopMetrics:
        bases = Counter(i.base for i in loop.body)
        return cls(
            instructions=len(loop.body),
            slots_per_element=round(len(loop.body) * threads / elements, 2),
            mma=dict(loop.mma),
            barriers=loop.count("BAR.SYNC", "BAR.ARV", "BAR.RED", "BAR"),
            shuffles=bases["SHFL"],
            wgmma_waits=loop.count("WARPGROUP.DEPBAR"),
            async_loads=bases["LDGSTS"] + bases["UTMALDG"],
            loads=bases["LDG"],
            address_ops=sum(bases[op] for op in ADDRESS_OPS),
            exp2=loop.count("MUFU.EX2"),
            opcodes=dict(sorted(bases.items(), key=lambda kv: -kv[1])),
        )

    def non_wgmma(self, reference_n: int = 16) -> list[str]:
        """Main-loop MMAs that are not wgmma, or wgmma narrower than the references'
        ``reference_n`` columns (a degenerate tile, such as N=8)."""
        bad = []
        for opcode in self.mma:
            if not opcode.startswith("HGMMA"):
                bad.append(opcode)
                continue
            shape = re.search(r"\.(\d+)x(\d+)x(\d+)", opcode)
            if shape and int(shape.group(2)) < reference_n:
                bad.append(opcode)
        return bad
