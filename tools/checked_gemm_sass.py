"""The checked GEMM's static gate, as a table: each launch of megatron_abft.ops.checked_gemm built
for sm_90 as checked_linear (the projections) and checked_matmul (the unfused attention's scores
and context) run it (megatron_abft.dev.gemm_gate), what ptxas and the SASS of its main loop say,
and what fails the gate (tests/ops/test_checked_gemm_gate.py fails on the same).

    python -m tools.checked_gemm_sass          # a markdown table, for docs/benchmarks.md
"""

from megatron_abft.dev.gemm_gate import attention_builds, builds


def main() -> None:
    print(
        "| launch | dtype | checked | bias | tile (m, n, k, warps, stages) | MMA in the loop | "
        "regs | CTA/SM | shared KiB | loop instructions (in the wgmma's flight) | "
        "issue / MMA cycles | gate |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for b in builds() + attention_builds():
        t = b.tile
        mma = ", ".join(f"{op.split('.F32')[0]} x{n}" for op, n in b.mma)
        print(
            f"| {b.launch} | {b.dtype} | {'yes' if b.check else 'no'} | "
            f"{'yes' if b.bias else 'no'} | "
            f"{t.block_m}, {t.block_n}, {t.block_k}, {t.num_warps}, {t.num_stages} | {mma} | "
            f"{b.registers} | {b.ctas_per_sm} | {b.shared // 1024} | "
            f"{b.loop_instructions} ({b.in_flight}) | {b.issue_cycles:.0f} / {b.mma_cycles:.0f} | "
            f"{'; '.join(b.problems) or 'pass'} |"
        )


if __name__ == "__main__":
    main()
