"""Time the compiled checksum kernels against the PyTorch path, on the attention scores' GEMM.

    python -m tools.bench_kernels [--batch 2] [--heads 8] [--seq 1024] [--head-dim 64]
                                  [--dtype bf16] [--block 256] [--device cpu] [--threads N]
                                  [--projection-tokens N] [--json PATH]

For S = Q K^T / sqrt(d) and the context P V (P = softmax(S)) it times the GEMMs themselves, the
encoding of both sides' checksums and a whole clean verify_and_correct, each through the
extension and through the PyTorch path (the reference), against the GEMM each guards and the
softmax over S (the unprotected work around them), without and with the GEMM's operands
(verify_correct: clean, and correcting one 0D fault); runs of the two paths alternate, and each
line reports the median. Then a layer's QKV and output projections (hidden = heads x head-dim,
``--projection-tokens`` tokens), each GEMM against its clean check as a protected linear layer
runs it, and (bf16) its checksum products on the CUDA cores and on the tensor cores; on a GPU
each against the GEMM that checks itself, and so the attention's two GEMMs.
Then each kernel alone (the ops a clean check runs, screen or verify_correct and encode_pair,
and the kernels they are made of), with its achieved bandwidth against a copy of the same
tensor on the same device (the bandwidth the device sustains). Last, the fused softmax against
Megatron's softmax with the checks it replaces, and softmax_correct_tally (the GPU's sync-free
check of the scores), clean and correcting one fault.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from bench.timing import best_per_call, call_ms, device_kernels
from megatron_abft.check.checksum import encode
from megatron_abft.check.eec import GemmOperands, _kernel_check, verify_and_correct
from megatron_abft.check.ledger import Ledger
from megatron_abft.check.sides import NO_SCREEN, Check, kernel_sides, screen
from megatron_abft.check.tolerance import gemm_rounding
from megatron_abft.config import DTYPES, ABFTConfig
from megatron_abft.ops import checked_gemm, compiled
from megatron_abft.runtime.guard import SectionGuard


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2, help="micro-batch size")
    parser.add_argument("--heads", type=int, default=8, help="attention heads")
    parser.add_argument("--seq", type=int, default=1024, help="sequence length")
    parser.add_argument("--head-dim", type=int, default=64, help="head dimension")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--block", type=int, default=256, help="checksum block length")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--repeat", type=int, default=15, help="timed runs per path")
    parser.add_argument(
        "--projection-tokens",
        type=int,
        default=None,
        help="tokens of the projections timed (default: batch x seq)",
    )
    parser.add_argument(
        "--json", type=Path, default=None, help="the projections and kernels' figures, as JSON"
    )
    return parser.parse_args(argv)


def compare(fn: Callable[[], object], device: torch.device, repeat: int) -> tuple[float, float]:
    """Median ms through the extension and through the PyTorch path, runs interleaved."""
    fused, reference = [], []
    for run in range(repeat + 1):  # the first run of each path warms up
        f = call_ms(fn, device)
        with compiled.disabled():
            r = call_ms(fn, device)
        if run:
            fused.append(f)
            reference.append(r)
    return statistics.median(fused), statistics.median(reference)


def projections(
    tokens: int, hidden: int, dtype: torch.dtype, device: torch.device, block: int, number: int
) -> dict[str, dict[str, float]]:
    """A layer's QKV (``3 hidden`` outputs and a bias) and output projections of ``tokens`` rows
    of ``hidden``: each GEMM's ms against its clean check's as a protected linear layer runs it
    (SectionGuard.check: the sync-free kernels on a GPU, the screen on a CPU), each the best of
    loops of ``number`` calls synchronised at their end (as in a step, where the host runs ahead
    of the device), and the check's cost as a fraction of its GEMM's; beside them the floor of
    any check that runs after its GEMM, a read of the output (half a copy of it), as a fraction
    of the GEMM's (megatron_abft.tuning.scaling.projection_costs predicts it). On a GPU also the
    GEMM that checks itself (megatron_abft.ops.checked_gemm), checked and not."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, hidden, generator=g).to(device=device, dtype=dtype)
    found = {}
    for section, width, biased in (("qkv", 3 * hidden, True), ("proj", hidden, False)):
        w = (torch.randn(width, hidden, generator=g) * hidden**-0.5).to(device=device, dtype=dtype)
        bias = torch.randn(width, generator=g).to(device=device, dtype=dtype) if biased else None

        def gemm(w=w, bias=bias) -> torch.Tensor:
            return x @ w.t() if bias is None else torch.addmm(bias, x, w.t())

        y, operands = gemm(), GemmOperands(x, w.t(), 1.0, bias)
        guard = SectionGuard(section, ABFTConfig(block_size=block), 0)
        guard.check(y, operands)  # a signature's first check takes the reference
        check = partial(guard.check, y, operands)
        # a copy of the output, into a tensor allocated once (a fresh one costs page faults)
        copy = partial(torch.empty_like(y).copy_, y)
        gemm_ms, check_ms, copy_ms = (
            best_per_call(fn, device, number) * 1e3 for fn in (gemm, check, copy)
        )
        found[section] = {
            "gemm_ms": gemm_ms,
            "check_ms": check_ms,
            "fraction": check_ms / gemm_ms,
            "floor_ms": copy_ms / 2,
            "floor_fraction": copy_ms / 2 / gemm_ms,
        }
        if compiled.available() and dtype == torch.bfloat16:
            found[section]["products"] = products_both_ways(x, w, block, device, number)
        if device.type == "cuda":  # the GEMM that checks itself, and its checks compiled out
            sums = checked_gemm.weight_sums(w, checked_gemm.tiles_for(device).block_n)
            fused = partial(checked_gemm.checked_linear, x, w, bias, sums=sums)
            plain = partial(checked_gemm.checked_linear, x, w, bias, check=False)
            fused_ms, plain_ms = (best_per_call(fn, device, number) * 1e3 for fn in (fused, plain))
            found[section].update(
                checked_gemm_ms=fused_ms,
                checked_gemm_fraction=fused_ms / gemm_ms - 1,
                triton_gemm_ms=plain_ms,
                # where each one's time goes, kernel by kernel
                check_kernels=device_kernels(check, device),
                checked_gemm_kernels=device_kernels(fused, device),
            )
    return found


def products_both_ways(
    x: torch.Tensor, w: torch.Tensor, block: int, device: torch.device, number: int
) -> dict[str, float]:
    """A projection's checksum products, ms: by the products kernel (row_products_pair, the
    CUDA cores) and by mma_products on both operands (the tensor cores), each operand against
    the other's block sums as encode_pair makes them. The check takes the tensor cores from
    2^22 elements of the larger operand (csrc/bindings/abft_binding.h, kMmaProductsMinElements);
    these two figures are what that threshold rests on."""
    ops = torch.ops.megatron_abft
    w_sums, w_sizes, _, _, x_sums, x_sizes, _, _ = ops.block_sums_pair(w, block, 0, x, block, 0)
    u, z = w_sums.flatten(-3, -2), w_sizes.select(-2, 0)  # against x's rows
    v, y = x_sums.flatten(-3, -2), x_sizes.select(-2, 0)  # against w's

    def tensor_cores() -> None:
        ops.mma_products(x, u, z)
        ops.mma_products(w, v, y)

    cuda_cores = partial(ops.row_products_pair, x, u, z, 1.0, w, v, y, 1.0)
    return {
        "cuda_cores_ms": best_per_call(cuda_cores, device, number) * 1e3,
        "tensor_cores_ms": best_per_call(tensor_cores, device, number) * 1e3,
    }


def attention_gemms(
    q: torch.Tensor, k: torch.Tensor, probs: torch.Tensor, v: torch.Tensor, scale: float,
    device: torch.device, number: int,
) -> dict[str, dict[str, float]]:  # fmt: skip
    """The unfused attention's scores ``scale Q K^T`` and context ``P V`` (``[b, heads, s, d]``
    operands): Megatron's GEMMs (``baddbmm``, ``bmm``) against the checked GEMM
    (checked_matmul, its K's or V's sums made in the call as the layers make them), checked and
    not, ms each as ``projections`` times them, and the checked GEMM's time over Megatron's."""
    b, heads, s, d = q.shape
    q3, k3, p3, v3 = (t.reshape(b * heads, *t.shape[2:]) for t in (q, k, probs, v))
    buffer = q3.new_empty(b * heads, s, s)
    gemms = {
        "scores": (
            partial(torch.baddbmm, buffer, q3, k3.mT, beta=0.0, alpha=scale),
            partial(checked_gemm.checked_matmul, q, k, alpha=scale),
        ),
        "context": (partial(torch.bmm, p3, v3), partial(checked_gemm.checked_matmul, probs, v.mT)),
    }
    found = {}
    for name, (megatron, checked) in gemms.items():
        gemm_ms, checked_ms, plain_ms = (
            best_per_call(fn, device, number) * 1e3
            for fn in (megatron, checked, partial(checked, check=False))
        )
        found[name] = {
            "gemm_ms": gemm_ms,
            "checked_gemm_ms": checked_ms,
            "checked_gemm_fraction": checked_ms / gemm_ms - 1,
            "triton_gemm_ms": plain_ms,
        }
    return found


def _kernel_line(kernels: dict) -> str:
    """device_kernels' record as one line: each kernel's microseconds a call, longest first."""
    if "error" in kernels:
        return kernels["error"]
    return ", ".join(f"{name[:40]} {row['us']:.1f} us" for name, row in kernels.items())


def _write(path: Path | None, result: dict) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    g = torch.Generator().manual_seed(0)
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    q = torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
    scale = args.head_dim**-0.5
    scores = q @ k.mT * scale
    col, row = encode(q, k.mT, alpha=scale, block=args.block)

    print(
        f"S = Q K^T / sqrt(d): {args.batch}x{args.heads} matrices of {args.seq}x{args.seq}, "
        f"d = {args.head_dim}, {args.dtype} on {device} ({torch.get_num_threads()} threads), "
        f"blocks of {args.block}; extension: {compiled.backend()}"
    )
    v = torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
    probs = torch.softmax(scores.float(), -1).to(dtype)
    context = probs @ v
    pv = encode(probs, v, block=args.block)

    def median(fn: Callable[[], object]) -> float:
        fn()
        return statistics.median(call_ms(fn, device) for _ in range(args.repeat))

    gemms = {"S": median(lambda: q @ k.mT), "PV": median(lambda: probs @ v)}
    operands = GemmOperands(q, k.mT, scale)
    faulty = scores.clone()

    def one_fault():  # lands a fault (one indexing op), then checks: the correction's cost
        faulty[0, 0, 5, 7] = 1e4
        return verify_and_correct(faulty, col, row, operands=operands, check_references=False)

    # the softmax as the protected attention runs it (fp32, back to the data dtype)
    softmax = median(lambda: torch.softmax(scores.float(), -1).to(dtype))
    print(
        f"the GEMMs: S {gemms['S']:.2f} ms, P V {gemms['PV']:.2f} ms; the softmax of S "
        f"{softmax:.2f} ms"
    )
    print(
        f"{'step':<38} {'kernels ms':>11} {'torch ms':>9} {'speed-up':>9} {'x GEMM':>7} "
        f"{'x softmax':>9}"
    )
    steps = {
        ("S", "encode Q, K (both sides)"): lambda: encode(q, k.mT, alpha=scale, block=args.block),
        ("S", "verify_and_correct S, clean"): lambda: verify_and_correct(
            scores, col, row, check_references=False
        ),
        ("S", "verify_and_correct S + operands, clean"): lambda: verify_and_correct(
            scores, col, row, operands=operands, check_references=False
        ),
        ("S", "... + operands, one 0D fault"): lambda: one_fault(),
        ("PV", "encode P, V (both sides)"): lambda: encode(probs, v, block=args.block),
        ("PV", "verify_and_correct PV, clean"): lambda: verify_and_correct(
            context, *pv, check_references=False
        ),
    }
    for (gemm, name), fn in steps.items():
        fused, reference = compare(fn, device, args.repeat)
        print(
            f"{name:<38} {fused:>11.2f} {reference:>9.2f} {reference / fused:>8.1f}x "
            f"{fused / gemms[gemm]:>7.2f} {fused / softmax:>9.2f}"
        )
    tokens, hidden = args.projection_tokens or args.batch * args.seq, args.heads * args.head_dim
    projected = projections(tokens, hidden, dtype, device, args.block, args.repeat)
    print(
        f"\nthe projections of {tokens} tokens, hidden {hidden}: ms, the check's share, and the "
        "floor's (a read of the output)"
    )
    for section, p in projected.items():
        print(
            f"{section:<5} GEMM {p['gemm_ms']:>8.3f}  its clean check {p['check_ms']:>8.3f}  "
            f"{p['fraction']:>7.1%}  floor {p['floor_ms']:>8.3f} {p['floor_fraction']:>7.1%}"
        )
        if "products" in p:
            print(
                f"{'':<5} its products: CUDA cores {p['products']['cuda_cores_ms']:>8.3f}, "
                f"tensor cores {p['products']['tensor_cores_ms']:>8.3f}"
            )
        if "checked_gemm_ms" in p:
            print(
                f"{'':<5} checked GEMM {p['checked_gemm_ms']:>8.3f} "
                f"({p['checked_gemm_fraction']:+.1%} over the GEMM), its checks compiled out "
                f"{p['triton_gemm_ms']:>8.3f}"
            )
            for what in ("check_kernels", "checked_gemm_kernels"):
                print(f"{'':<5} {what}: {_kernel_line(p[what])}")
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype,
        "projections": {"tokens": tokens, "hidden": hidden, **projected},
        "kernels": {},
    }
    if device.type == "cuda":
        result["attention_gemms"] = attention_gemms(q, k, probs, v, scale, device, args.repeat)
        print("\nthe attention's GEMMs, Megatron's against the checked GEMM: ms")
        for name, a in result["attention_gemms"].items():
            print(
                f"{name:<8} GEMM {a['gemm_ms']:>8.3f}  checked GEMM {a['checked_gemm_ms']:>8.3f} "
                f"({a['checked_gemm_fraction']:+.1%}), its checks compiled out "
                f"{a['triton_gemm_ms']:>8.3f}"
            )
    if not compiled.available():
        _write(args.json, result)
        return
    u = torch.randn(*shape[:2], 2 * -(-args.head_dim // args.block), args.seq, device=device)
    check = Check(gemm_rounding(dtype, device), 1.0, 1e10, 0, None)
    with_operands = Check(check.rounding, 1.0, 1e10, args.seq, operands)
    kernels = {  # name: (call, bytes it reads)
        "screen of S (a clean verify)": (
            lambda: screen(scores, {"col": col, "row": row}, check),
            scores.nbytes,
        ),
        "verify_correct of S, clean": (
            lambda: _kernel_check(scores, {"col": col, "row": row}, with_operands),
            scores.nbytes,
        ),
        "block_sums of S, both sides": (
            lambda: compiled.block_sums(scores, args.block, args.block),
            scores.nbytes,
        ),
        "encode_pair of P, V (encode)": (  # P once on a CPU, twice on a GPU; V twice
            lambda: compiled.encode_pair(probs, v, 1.0, args.block),
            (2 if device.type == "cuda" else 1) * probs.nbytes + 2 * v.nbytes,
        ),
        "encode_pair_split (a GPU's steps)": (  # two ops: both block sums, both products
            lambda: torch.ops.megatron_abft.encode_pair_split(probs, v, 1.0, args.block),
            2 * probs.nbytes + 2 * v.nbytes,
        ),
        "block_sums of P, one side (encode)": (
            lambda: compiled.block_sums(probs, args.block, 0),
            probs.nbytes,
        ),
        "row_products of P (encode)": (
            lambda: compiled.row_products(probs, u, u[..., :1, :].abs()),
            probs.nbytes,
        ),
        "operand_pass of P: both in one read": (
            lambda: torch.ops.megatron_abft.operand_pass(probs, args.block, u, u[..., :1, :].abs()),
            probs.nbytes,
        ),
    }
    destination = torch.empty_like(scores)  # allocated once: a fresh one costs page faults
    copy = median(lambda: destination.copy_(scores)) / 1e3
    bandwidth = 2 * scores.nbytes / copy
    print(f"\ncopy of S: {copy * 1e3:.2f} ms, {bandwidth / 1e9:.1f} GB/s (read + write)")
    print(f"{'kernel':<38} {'ms':>8} {'GB/s':>8} {'of copy':>8}")
    for name, (fn, nbytes) in kernels.items():
        ms = median(fn)
        achieved = nbytes / (ms / 1e3)
        print(f"{name:<38} {ms:>8.2f} {achieved / 1e9:>8.1f} {achieved / bandwidth:>7.0%}")
        result["kernels"][name] = {"ms": ms, "of_copy": achieved / bandwidth}
    _write(args.json, result)
    fused_softmax(scores, v, col, row, check, args.block, median, (q, k.mT, scale))


def fused_softmax(scores, v, col, row, check, block: int, median, operands) -> None:
    """The fused softmax against what it replaces: Megatron's causal softmax (masked_fill, softmax
    in fp32, back to the dtype), the screen of S and P's pass for the context's checksums; and
    softmax_correct_tally, the GPU's sync-free check of the scores, clean and correcting one
    fault (S = alpha Q K^T, ``operands`` (Q, K^T, alpha))."""
    sq, sk = scores.shape[-2:]
    mask = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).triu(1)
    sides = kernel_sides(scores, {"col": col, "row": row}, check)
    vectors = compiled.pair_vectors(scores, v, block)

    def megatron():
        return torch.softmax(scores.float().masked_fill(mask, -10000.0), -1).to(scores.dtype)

    def unfused():
        probs = megatron()
        compiled.screen(scores, *sides)
        return torch.ops.megatron_abft.operand_pass(probs, block, *vectors, 1.0)

    def pass_unfused():
        return torch.ops.megatron_abft.operand_pass(megatron(), block, *vectors, 1.0)

    ledger = Ledger.on(scores.device, 0)
    faulty = scores.clone()

    def corrected(s):
        return compiled.softmax_correct_tally(
            s, sides, None, True, 1.0, block, vectors, operands, 1e10, max(sq, sk), ledger
        )

    def one_fault():  # lands a fault (one indexing op); the op corrects it and redoes P
        faulty[0, 0, 5, 7] = 1e4
        return corrected(faulty)

    rows = {
        "Megatron's softmax (causal)": megatron,
        "... + screen of S + pass over P": unfused,
        "... + pass over P (sync-free GPU)": pass_unfused,
        "softmax_check, softmax alone": lambda: compiled.softmax_check(
            scores, NO_SCREEN, None, True, 1.0, block, None
        ),
        "softmax_check + screen of S": lambda: compiled.softmax_check(
            scores, sides, None, True, 1.0, block, None
        ),
        "softmax_check + screen + P's pass": lambda: compiled.softmax_check(
            scores, sides, None, True, 1.0, block, vectors
        ),
        "softmax_check + P's pass (sync-free)": lambda: compiled.softmax_check(
            scores, NO_SCREEN, None, True, 1.0, block, vectors
        ),
        "softmax_correct_tally + pass, clean": lambda: corrected(scores),
        "... one 0D fault: corrected, P redone": one_fault,
    }
    print(f"\n{'the fused softmax (softmax_check)':<38} {'ms':>8}")
    for name, fn in rows.items():
        print(f"{name:<38} {median(fn):>8.2f}")
