"""The overhead report: what protection will cost on common models, and how far to trust it.

Writes a report (docs/scaling.md is one, its command in its first lines): the model's
predictions for the GPT-3 family and Llama-2/3 shapes at sequence lengths 2k, 4k and 8k on a
chosen device, the unfused attention's and the flash attention's (its kernels' own rates from
datasheets), the two side by side on every GPU profile, a plot of step overhead against
parameter count, and a validation table of predicted against measured overhead for every
benchmark result given (tools/bench_overhead.py JSON), each predicted with a device profile
calibrated from that run's own micro-benchmarks.

    python -m tools.overhead_report --device H100 --measured docs/figures/bench_cpu.json

writes the report and its plot under out/ (``--out``, ``--plot``: elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import textwrap
from dataclasses import replace
from pathlib import Path

from megatron_abft.config import FLASH_SECTIONS, FORWARD_SECTIONS, SECTIONS
from megatron_abft.tuning.devices import (
    BIAS_KERNELS,
    BIAS_OPS,
    CHECK_KERNELS,
    CHECK_OPS,
    DEVICES,
    DeviceProfile,
)
from megatron_abft.tuning.flash_work import (
    CHECK_ROW_OPS,
    IDENTITY_OPS,
    PREPASS,
    RETRY_OPS,
    flash_protection,
    flash_shared,
)
from megatron_abft.tuning.scaling import (
    FUSED_SECTIONS,
    MMA_PRODUCTS_MIN_ELEMENTS,
    checks_of,
    forward_backward_time,
    predict,
    projection_costs,
    protection_forward,
    step_time,
    unfused_scores_bytes,
)
from megatron_abft.tuning.shapes import CATALOGUE, ModelShape, Work

SEQUENCES = (2048, 4096, 8192)
MICRO_BATCHES = (1, 8)
"""Micro-batches of the table that sets the two attentions side by side."""
EXAMPLE = ("GPT-3 350M", 2048)
"""The model and sequence the text's worked example of the flash path takes, at micro-batch 1."""
TERMS = {
    "ops": "launches",
    "bytes": "memory",
    "vector": "CUDA cores",
    "flops": "tensor cores",
    "exps": "exp2",
    "dots": "dot products",
    "stream": "library ops' memory",
    "launches": "library ops' launches",
}
"""DeviceProfile.check_terms' kinds of work, as the report names them."""
ATTNCHECKER = 0.07
TOLERANCE = (0.25, 0.01)  # relative, absolute (percentage points): the looser one applies
WRAP = 88
"""Line length of the generated text that is wrapped rather than written line by line."""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=DEVICES, default="H100")
    p.add_argument("--measured", type=Path, nargs="*", default=[], help="bench_overhead JSON")
    p.add_argument("--out", type=Path, default=Path("out", "scaling.md"))
    p.add_argument("--plot", type=Path, default=Path("out/overhead_vs_params.png"))
    return p.parse_args()


def measured_shape(args: dict) -> ModelShape:
    return ModelShape(
        "measured",
        args["layers"],
        args["hidden"],
        args["heads"],
        args["ffn"] or 4 * args["hidden"],
        args["vocab"],
        seq=args["seq"],
        micro_batch=args["micro_batch"],
        tp=args["tp"],
        kv_groups=args["kv_groups"],
        dtype=args["dtype"],
        block=args["block"],
    )


def calibrated(result: dict) -> DeviceProfile:
    """The device of a benchmark run, from its micro-benchmarks, with the baseline's forward
    and backward (the flash attention's, on the flash path) scaled to the run's unprotected
    steps (DeviceProfile.baseline_scale)."""
    rates = roofline(result)
    off = result["median"]["off"]
    measured = off["step"] - off["optimizer"]
    flash = result.get("impl") == "flash"
    counted = forward_backward_time(measured_shape(result["args"]), rates, flash)
    return replace(rates, baseline_scale=measured / counted)


EARLIER_OPS = {"torch": 124, "kernels": 4, "fused": 4}
"""CHECK_OPS of the code that ran before check_gemm, in the runs that count no ``bias_ops``:
encode_pair and verify_correct were ops of their own, and a bias's add_bias one more
(BIAS_KERNELS)."""


def roofline(result: dict) -> DeviceProfile:
    """The device of a benchmark run as its micro-benchmarks give it, the baseline at the
    model's count (baseline_scale 1)."""
    m, impl = result["machine"], result.get("impl", "torch")
    code_ops, code_bias = (CHECK_OPS, BIAS_OPS) if "bias_ops" in m else (EARLIER_OPS, BIAS_KERNELS)
    return DeviceProfile(
        f"{result['device']} (calibrated)",
        {result["args"]["dtype"]: m["matmul"]},
        m["bandwidth"],
        m["launch"],
        "bench_overhead micro-benchmarks",
        check_op=m.get("check_op"),  # the checks' own ops, the Python around them included
        optimizer_bandwidth=m.get("optimizer_bandwidth"),  # the bench's timed optimizer steps
        check_bandwidth=m.get("check_bandwidth"),  # the kernels reading the scores from memory
        check_dot=m.get("check_dot") or 0.0,  # their dot products' own cost (CPU runs)
        # a check's ops and a bias's in its code: the run's own count where it made one
        check_ops={**code_ops, **({checks_of(impl): m["check_ops"]} if "check_ops" in m else {})},
        bias_ops={**code_bias, **({checks_of(impl): m["bias_ops"]} if "bias_ops" in m else {})},
        # both softmaxes and the fused softmax's checks, timed on the machine
        softmax=m.get("softmax"),
        # the checksum products' multiply-adds on a CPU's vector units, at its BLAS rate; on a
        # GPU the CUDA-core (and the flash kernels' exp2) rates: not micro-benchmarked, the
        # datasheet's
        **(
            {"vector": m["matmul"] / 2}
            if result["device"] == "cpu"
            else datasheet_rates(result["device"])
        ),
    )


def datasheet_rates(device: str) -> dict[str, float]:
    """The CUDA-core and exp2 rates (vector, exp) of the DEVICES profile ``device`` names, e.g.
    "NVIDIA H200": a GPU run does not measure them."""
    for key, profile in DEVICES.items():
        if key in device:
            return {"vector": profile.vector, "exp": profile.exp}
    raise ValueError(f"{device}: no GPU profile in DEVICES ({', '.join(DEVICES)}) for its rates")


def within(predicted: float, measured: float) -> bool:
    relative, absolute = TOLERANCE
    return abs(predicted - measured) <= max(relative * abs(measured), absolute)


def within_relative(predicted: float, measured: float) -> bool:
    return abs(predicted - measured) <= TOLERANCE[0] * abs(measured)


def in_interval(predicted: float, measured: float, interval: float | None) -> bool | None:
    """Whether the prediction lies in the measurement's 95% interval (None: not measured)."""
    return None if interval is None else abs(predicted - measured) <= interval


def validation_rows(paths: list[Path]) -> list[dict]:
    rows = []
    for path in paths:
        result = json.loads(path.read_text())
        shape = measured_shape(result["args"])
        impl = result.get("impl", "torch")
        device = calibrated(result)
        prediction = predict(shape, device, impl)
        a = result["args"]
        dated = re.fullmatch(r"\d{4}-\d{2}-\d{2}", path.parent.name)  # a run's folder
        label = f"{path.parent.name}/{path.stem}" if dated else path.stem
        name = (
            f"{label}: {a['layers']}L h{a['hidden']} s{a['seq']} b{a['micro_batch']} "
            f"TP{a['tp']} {a['dtype']} on {result['device']} ({impl})"
        )
        measured, spread = result["overhead"], result.get("interval", {})
        cases = [
            (s, prediction.sections[s], measured[s]["step"], spread.get(s, {}).get("step"))
            for s in FORWARD_SECTIONS
            if s in measured
        ]
        for what, key, p in (
            ("step, all", "step", prediction.step),
            ("attention, all", "attention", prediction.attention),
        ):
            cases.append((what, p, measured["all"][key], spread.get("all", {}).get(key)))
        for what, p, m, interval in cases:
            rows.append(
                {
                    "config": name,
                    "what": what,
                    "unit": "%",
                    "predicted": p,
                    "measured": m,
                    "interval": interval,
                    "ok": within(p, m),
                    "in_interval": in_interval(p, m, interval),
                    "softmax_timed": device.softmax is not None,
                }
            )
        # the checks' own time, one layer: measured inside the training step, far less noisy
        # on the flash path the projections' checks are the kernels' checks of a linear layer
        linear = "kernels" if impl == "flash" else impl
        checks = checks_of(linear)
        work = protection_forward(
            shape, linear, device.ops_per_check(checks), device.ops_per_bias(checks), device.gpu
        )
        for section, seconds in result.get("check_seconds", {}).items():
            p = device.check_time(work[section], shape.dtype)
            rows.append(
                {
                    "config": name,
                    "what": f"{section} check",
                    "unit": "ms",
                    "predicted": p,
                    "measured": seconds,
                    "interval": None,
                    "ok": within_relative(p, seconds),
                    "in_interval": None,
                }
            )
        if set(result.get("check_seconds", {})) == set(FORWARD_SECTIONS):
            # the same checks summed over the layers, as a share of the unprotected step: what
            # the step overhead would be if the step grew by exactly the checks' time (with
            # the fused softmax, its screen and pass and its difference to Megatron's softmax aside)
            own = (
                a["layers"]
                * sum(result["check_seconds"].values())
                / result["median"]["off"]["step"]
            )
            p = (
                a["layers"]
                * sum(device.check_time(w, shape.dtype) for w in work.values())
                / prediction.step_seconds
            )
            rows.append(
                {
                    "config": name,
                    "what": "checks' own time, all",
                    "unit": "%",
                    "predicted": p,
                    "measured": own,
                    "interval": None,
                    "ok": within(p, own),
                    "in_interval": None,
                }
            )
        rows.append(  # the roofline's own step: what baseline_scale calibrates away
            {
                "config": name,
                "what": "baseline step, roofline",
                "unit": "s",
                "predicted": step_time(shape, roofline(result), impl == "flash"),
                "measured": result["median"]["off"]["step"],
                "interval": None,
                "ok": None,
                "in_interval": None,
            }
        )
    return rows


def plot(device: DeviceProfile, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9.5, 4.5))
    lines = (("fused", "-"), ("kernels", "--"), ("torch", ":"), ("flash", "-."))
    for seq, color in zip(SEQUENCES, ("C0", "C1", "C2"), strict=True):
        for impl, style in lines:
            points = sorted(
                (shape.parameters(), predict(replace(shape, seq=seq), device, impl).step)
                for shape in CATALOGUE
            )
            ax.semilogx(
                [p for p, _ in points],
                [100 * o for _, o in points],
                style,
                color=color,
                marker="o",
                markersize=3,
                label=f"seq {seq // 1024}k, {impl}" + (" (predicted)" if impl == "flash" else ""),
            )
    ax.axhline(100 * ATTNCHECKER, color="grey", linestyle=":", label="ATTNChecker (7%)")
    ax.set_xlabel("parameters")
    ax.set_ylabel("predicted step overhead (%)")
    ax.set_yscale("log")
    ax.set_title(f"ABFT step overhead, every section every step, bf16, {device.name}")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # off the lines
    ax.grid(True, which="both", alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def prediction_table(device: DeviceProfile) -> list[str]:
    lines = [
        "| model | TP | seq | impl | "
        + " | ".join(FORWARD_SECTIONS)
        + " | attention | step | step s |",
        "|---" * (len(FORWARD_SECTIONS) + 7) + "|",
    ]
    for shape in CATALOGUE:
        for seq in SEQUENCES:
            for impl in ("fused", "kernels", "torch"):
                p = predict(replace(shape, seq=seq), device, impl)
                cells = " | ".join(f"{100 * p.sections[s]:.2f}%" for s in FORWARD_SECTIONS)
                lines.append(
                    f"| {shape.name} | {shape.tp} | {seq} | {impl} | {cells} | "
                    f"{100 * p.attention:.1f}% | **{100 * p.step:.2f}%** | "
                    f"{p.step_seconds:.3f} |"
                )
    return lines


def projections_text(device: DeviceProfile) -> list[str]:
    flop_per_byte = device.matmul["bf16"] / device.bandwidth
    return [
        f"On the {device.name}, bf16, sequence 2048, forward, one rank: each projection's GEMM,",
        "its clean check as the kernels run it (`encode_pair`, `add_bias`, the screen of the",
        "output), and the floor, one read of the output at the bandwidth, which any check that",
        "runs after its GEMM pays to sum that output (`scaling.projection_costs`). Over the GEMM",
        "the floor is about (matmul rate / bandwidth) / k, k the GEMM's inner dimension: "
        f"{flop_per_byte:.0f} / k",
        "at this profile's rates. The qkv projection's k is the",
        "hidden size; the output projection's is the hidden size over the tensor-parallel ranks,",
        "so its floor grows with the ranks. A check at 2% of its GEMM is out of reach for any",
        "check that reads the output again: only sums taken from the GEMM's own fp32",
        "accumulators, in its epilogue (a GEMM of our own), read nothing again. At the step the",
        "floor weighs less: the projections are a third of a layer's forward GEMM FLOPs (the",
        "MLP's the rest, the attention's aside), and their checks are forward work only.",
    ]


def projections_table(device: DeviceProfile) -> list[str]:
    lines = [
        "| model | TP | micro-batch | qkv GEMM ms | qkv check | qkv floor | proj GEMM ms "
        "| proj check | proj floor |",
        "|---" * 9 + "|",
    ]
    for shape in CATALOGUE:
        for micro_batch in (1, 8):
            costs = projection_costs(replace(shape, seq=2048, micro_batch=micro_batch), device)
            cells = " | ".join(
                f"{1e3 * c.gemm:.3f} | {100 * c.check / c.gemm:.0f}% | "
                f"{100 * c.floor / c.gemm:.1f}%"
                for c in (costs["qkv"], costs["proj"])
            )
            lines.append(f"| {shape.name} | {shape.tp} | {micro_batch} | {cells} |")
    return lines


def flash_table(device: DeviceProfile) -> list[str]:
    """The flash path's predictions on ``device``, section by section: qkv and proj as the
    unfused attention's kernels check them, each flash section's own extra time, and
    ``shared``, what any of them brings once a step."""
    own = [s for s in SECTIONS if s in FLASH_SECTIONS]
    around = [s for s in SECTIONS if s not in FLASH_SECTIONS]
    lines = [
        "| model | TP | seq | "
        + " | ".join(around + own)
        + " | shared | attention | step | step s |",
        "|---" * (len(SECTIONS) + 7) + "|",
    ]
    for shape in CATALOGUE:
        for seq in SEQUENCES:
            p = predict(replace(shape, seq=seq), device, "flash")
            cells = [p.sections[s] for s in around] + [p.sections[s] - p.shared for s in own]
            lines.append(
                f"| {shape.name} | {shape.tp} | {seq} | "
                + " | ".join(f"{100 * c:.2f}%" for c in cells)
                + f" | {100 * p.shared:.2f}% | {100 * p.attention:.1f}% | "
                f"**{100 * p.step:.2f}%** | {p.step_seconds:.3f} |"
            )
    return lines


def flash_terms(shape: ModelShape, device: DeviceProfile) -> dict[str, float]:
    """The flash attention's checks (its sections' own work and the shared), one layer, in
    seconds by kind of work (DeviceProfile.check_terms)."""
    work = sum((*flash_protection(shape).values(), *flash_shared(shape).values()), Work())
    return device.check_terms(work, shape.dtype)


def largest_term(shape: ModelShape, device: DeviceProfile) -> str:
    """What takes most of the flash attention's checks' time, and its share."""
    terms = flash_terms(shape, device)
    kind = max(terms, key=terms.get)
    return f"{TERMS[kind]} {100 * terms[kind] / sum(terms.values()):.0f}%"


def paths_table(device: DeviceProfile) -> list[str]:
    """Both attentions' step overheads on every GPU profile (the unfused attention with the fused
    softmax, the flash attention), every section every step, with the unfused attention's S and what
    dominates the flash path's checks on ``device``."""
    devices = list(DEVICES.values())
    label = next((key for key, d in DEVICES.items() if d == device), device.name)
    lines = [
        "| model | TP | seq | micro-batch | S a layer, unfused | "
        + " | ".join(f"{key} unfused | {key} flash" for key in DEVICES)
        + f" | flash's largest term, {label} |",
        "|---" * (5 + 2 * len(devices) + 1) + "|",
    ]
    for shape in CATALOGUE:
        for seq in SEQUENCES:
            for micro_batch in MICRO_BATCHES:
                at = replace(shape, seq=seq, micro_batch=micro_batch)
                cells = [
                    f"{100 * predict(at, d, impl).step:.1f}%"
                    for d in devices
                    for impl in ("fused", "flash")
                ]
                lines.append(
                    f"| {shape.name} | {shape.tp} | {seq} | {micro_batch} | "
                    f"{unfused_scores_bytes(at) / 2**30:.2f} GiB | "
                    + " | ".join(cells)
                    + f" | {largest_term(at, device)} |"
                )
    return lines


def flash_method() -> list[str]:
    """How the flash path is modelled, for "How the prediction is made"."""
    prepass = sum(p.launches for c in PREPASS.values() for p in c)
    text = (
        "The flash path (`flash`: the protected flash attention, `megatron_abft.flash`) is "
        "priced for the GPU profiles only, its kernels' CUDA-core and exp2 rates from datasheets "
        "(no benchmark measures them apart); H200 runs of GPT-3 350M on it are in the "
        "validation rows, priced with the H200's datasheet rates for those two. Its baseline is "
        "the unprotected step with the same Triton kernels, the "
        "checks compiled out, in place of the unfused attention's scores, softmax and context. "
        "For each element of S they compute (causal: the tiles up to the diagonal, whole; tile "
        "shapes from `launch.blocks`) the kernels run 2 tile GEMMs forward and 7 backward (S and "
        "dP are computed in both backward kernels: 3.5x the forward, not FlashAttention-2's "
        "2.5x) on the tensor cores, in each kernel an exp2 on the special-function units "
        "(3.9 T/s on an H100, FlashAttention-3 section 3: at head dim 64 as long as the "
        "forward's GEMMs) and "
        "8 or 9 elementwise ops on the CUDA cores (half the datasheet's fp32 FLOP/s, an FMA one "
        "op), each rate at 70% of its peak and their times added: an FA2-style kernel overlaps "
        "none of them with the tensor cores. Its bytes are O(seq x head_dim), where the unfused "
        "attention writes S and P (`S a layer` below). A check of S or dP adds the rows of "
        "each tile up on the CUDA cores (an add an element) and compares them once a program "
        "with one 16-wide MMA of the program's head_dim-wide tile against the summed checksums; "
        "an accumulating GEMM (the context, dV, dK, dQ) adds a 16-wide MMA a tile on the tensor "
        "cores (16 over head_dim of the GEMM) and compares its output's row sums once a "
        f"program; a comparison is {CHECK_ROW_OPS} ops a row. On any "
        "step that checks any flash section, the launches also make their checksum tiles "
        f"({prepass} Triton launch{'es' * (prepass != 1)} "
        "a layer, the backward's in its Delta launch, each tile reading its operand once more), "
        "the backward the rounding "
        f"of Delta, the dQ kernel its row identities ({IDENTITY_OPS} "
        f"op{'s' * (IDENTITY_OPS != 1)} an element of S), each "
        f"kernel launches a second pass ({RETRY_OPS} launches, whose clean programs return at "
        "once; the last program of the forward's and of the backward's last one updates the "
        "ledger): the "
        "`shared` column, paid once a step whichever flash sections are due (a kernel with none "
        "of its own sections due makes no tiles). qkv and proj are checked as by "
        "`kernels`. Every figure of the flash path is the model's count of what the code does, "
        "priced at datasheet rates."
    )
    return textwrap.wrap(text, WRAP)


def flash_example(device: DeviceProfile) -> list[str]:
    """The text's worked example of the flash path: one model and sequence at micro-batch 1."""
    name, seq = EXAMPLE
    shape = replace(next(s for s in CATALOGUE if s.name == name), seq=seq)
    flash, unfused = predict(shape, device, "flash"), predict(shape, device, "fused")
    terms = flash_terms(shape, device)
    total = sum(terms.values())
    shares = ", ".join(
        f"{TERMS[k]} {100 * v / total:.0f}%"
        for k, v in sorted(terms.items(), key=lambda kv: -kv[1])
        if v > 0
    )
    shared = flash_shared(shape)
    around = sum(
        device.check_time(shared[p], shape.dtype) for p in ("prepass", "odo", "retry", "ledger")
    )
    text = (
        f"For {name} at sequence {seq}, micro-batch 1 on the {device.name} the unprotected step "
        f"takes {flash.step_seconds * 1e3:.0f} ms with the flash attention against "
        f"{unfused.step_seconds * 1e3:.0f} ms with the unfused one. The flash attention's checks "
        f"take {total * 1e3:.2f} ms a layer ({shares}), {100 * around / total:.0f}% of it in "
        "the launches around the attention kernels (the checksum tiles, the rounding of "
        "Delta, the second passes, the ledger) rather than in them; protecting every "
        "section every step costs "
        f"{100 * flash.step:.0f}% of the step, against {100 * unfused.step:.1f}% for the "
        "unfused attention with the fused softmax."
    )
    return textwrap.wrap(text, WRAP)


def main() -> None:
    args = parse_args()
    device = DEVICES[args.device]
    rows = validation_rows(args.measured)
    for path in (args.out, args.plot):
        path.parent.mkdir(parents=True, exist_ok=True)
    plot(device, args.plot)
    print(
        f"{'config':<48} {'what':<16} {'predicted':>10} {'measured':>10} {'95% ±':>7}  ok"
        "  in interval"
    )
    for r in rows:
        interval = "" if r["interval"] is None else f"{100 * r['interval']:.2f}"
        print(
            f"{r['config'][:48]:<48} {r['what']:<16} {shown(r, 'predicted'):>10} "
            f"{shown(r, 'measured'):>10} {interval:>7}  "
            f"{'' if r['ok'] is None else r['ok']}  "
            f"{'' if r['in_interval'] is None else r['in_interval']}"
        )
    args.out.write_text(render(device, rows, args))
    print(f"wrote {args.out} and {args.plot}")


SCALE = {"%": 100, "ms": 1e3, "s": 1}


def shown(row: dict, key: str) -> str:
    """A row's predicted or measured value in its unit."""
    digits = 3 if row["unit"] == "s" else 2
    space = "" if row["unit"] == "%" else " "
    return f"{SCALE[row['unit']] * row[key]:.{digits}f}{space}{row['unit']}"


def summary(rows: list[dict]) -> list[str]:
    """What the validation rows say, in numbers taken from them."""
    judged = [r for r in rows if r["ok"] is not None]
    if not judged:
        return ["No measurement was given: the predictions below are the model's alone."]

    def span(values: list[float], unit: str) -> str:
        low, high = min(values), max(values)
        return f"{low:.0f}{unit}" if round(low) == round(high) else f"{low:.0f} to {high:.0f}{unit}"

    def of(what: str, key: str) -> list[float]:
        return [100 * r[key] for r in rows if r["what"] == what]

    lines = [
        f"{sum(bool(r['ok']) for r in judged)} of {len(judged)} rows agree within the tolerance.",
    ]
    widths = [
        100 * r["interval"] for r in judged if r["what"] in FORWARD_SECTIONS and r["interval"]
    ]
    if widths:
        lines += [
            "A single section costs a point or two of the step on the CPU, and the 95%",
            f"intervals of those rows run from ±{min(widths):.1f} to ±{max(widths):.1f} points:",
            "the noisier runs can hardly tell a good model from a bad one.",
        ]
    checks = [r for r in rows if r["unit"] == "ms" and r["measured"]]
    if checks:
        errors = [100 * (r["predicted"] / r["measured"] - 1) for r in checks]
        low, high = (checks[errors.index(f(errors))]["what"].split()[0] for f in (min, max))
        lines += [
            "The `check` rows can. The model costs every byte a check reads at the rate the",
            "kernels read a matrix that is in no cache (`check_bandwidth`, measured by the",
            "benchmark; the streaming bandwidth for runs that did not measure it) and every dot",
            "product of their checksum products at `check_dot` (measured; 0 for runs that did",
            f"not measure it), and its check times are off by {min(errors):+.0f}% to",
            f"{max(errors):+.0f}% by section ({low} lowest, {high} highest).",
        ]
    roofline_rows = [r for r in rows if r["what"] == "baseline step, roofline"]
    if roofline_rows:
        errors = [100 * (r["predicted"] / r["measured"] - 1) for r in roofline_rows]
        lines += [
            f"The roofline alone is off the measured unprotected step by {span(errors, '%')}",
            "(`baseline step, roofline`): the calibrated profiles take the measured forward and",
            "backward instead, so that the overhead rows judge the model of the checks.",
        ]
    untimed = [
        r
        for r in judged
        if "(fused)" in r["config"]
        and r["what"] in FUSED_SECTIONS
        and not r["ok"]
        and not r.get("softmax_timed")
    ]
    if untimed:
        lines += [
            "With the fused softmax (`fused`), in runs that did not time the softmaxes, the",
            "scores and context sections alone measured",
            f"{span([100 * r['measured'] for r in untimed], '%')} against",
            f"{span([100 * r['predicted'] for r in untimed], '%')} predicted. On the CPU",
            "the fused softmax also replaces Megatron's masked_fill and softmax, which torch runs",
            "well below the bandwidth those runs price a softmax at: a saving the model can only",
            "count where the benchmark timed both softmaxes (`softmax` in its JSON).",
        ]
    step = of("step, all", "measured")
    lines += [
        f"For the step it predicts {span(of('step, all', 'predicted'), '%')} against "
        f"{span(step, '%')} measured, and for the attention block",
        f"{span(of('attention, all', 'predicted'), '%')} against "
        f"{span(of('attention, all', 'measured'), '%')}.",
    ]
    # without the fused softmax, whose softmax changes the step besides its checks
    pairs, last_step = [], None  # each such run's step overhead with its checks' own time
    for r in rows:
        if "(fused)" in r["config"] or "(apart)" in r["config"]:
            continue
        if r["what"] == "step, all":
            last_step = r["measured"]
        elif r["what"] == "checks' own time, all":
            pairs.append((last_step, r["measured"]))
    if pairs:
        same = all(within(step_overhead, checks) for step_overhead, checks in pairs)
        own_time = span([100 * c for _, c in pairs], "%")
        growth = span([100 * s for s, _ in pairs], "%")
        lines += [
            "Without the fused softmax the model takes a step's overhead to be the time of its",
            "checks.",
            f"Timed inside the steps, the checks add up to {own_time}",
            f"of the unprotected step, and the step grows by {growth}"
            + (
                ": the same, within the tolerance."
                if same
                else ", which the model does not explain."
            ),
        ]
    return lines


def render(device: DeviceProfile, rows: list[dict], args) -> str:
    validation = [
        "| benchmark | overhead of | predicted | measured (95% interval) | within ±25% or ±1 pp "
        "| in the interval |",
        "|---|---|---|---|---|---|",
    ]

    def yes(flag: bool | None) -> str:
        return "(not measured)" if flag is None else "yes" if flag else "**no**"

    for r in rows:
        interval = "" if r["interval"] is None else f" ± {100 * r['interval']:.2f}"
        ok = "(for reference)" if r["ok"] is None else yes(r["ok"])
        if r["unit"] == "ms":
            ok += " (±25%)"
        validation.append(
            f"| {r['config']} | {r['what']} | {shown(r, 'predicted')} | "
            f"{shown(r, 'measured')}{interval} | {ok} | "
            f"{'' if r['unit'] != '%' or r['interval'] is None else yes(r['in_interval'])} |"
        )
    measured = " ".join(str(p) for p in args.measured)
    return "\n".join(
        [
            "# Scaling: what protection costs as models grow",
            "",
            "Generated by `tools/overhead_report.py`; the model is `megatron_abft/tuning/`: "
            "`scaling.py` (the predictions), `shapes.py`, `devices.py` and `flash_work.py`.",
            "",
            f"    python -m tools.overhead_report --device {args.device} --measured {measured} \\",
            f"        --out {args.out} --plot {args.plot}",
            "",
            "## How the prediction is made",
            "",
            "For each layer and tensor-parallel rank the model counts the baseline work of a",
            "training step (FLOPs of every GEMM, forward and backward; bytes of the softmax,",
            "norms, residuals and the MLP activation; Adam's traffic; the number of tensor ops)",
            "and the extra forward work of each checked section: encoding both operands, the",
            "checksum products (fp32 multiply-adds on the CUDA cores, a CPU's vector units; on a",
            "GPU, bf16 GEMMs on the tensor cores for a 2-D GEMM whose larger operand has",
            f"{MMA_PRODUCTS_MIN_ELEMENTS:,} elements or more: a projection's), and",
            "verifying C. Work becomes time with a device profile: `flops / matmul rate +",
            "multiply-adds / vector rate + bytes / bandwidth + ops x op latency`, and for the",
            "checks on a CPU their kernels' dot products (a row of an operand against one checksum",
            "vector)",
            "at a fixed cost each beyond the multiply-adds (`check_dot`; for an operand head_dim",
            "wide, as Q, K and V are, most of their products' time). Four implementations",
            "are modelled: `torch`, the PyTorch path (every fp32 copy, abs and reduction",
            "counted); `kernels`, the code as it runs with the compiled kernels (a clean check is",
            "one of their ops, `check_gemm`: `encode_pair` reads the larger operand once and the",
            "smaller twice, `verify_correct` reads C once for both sides and corrects a flagged",
            "matrix on the device; on a CPU a clean check is",
            f"{CHECK_OPS['kernels']} call into the kernels (`check_gemm`'s screen alone,",
            f"`screen_passes`), {BIAS_OPS['kernels']} more for a bias, whose terms `add_bias` adds",
            "in the same call, figures a test keeps equal to the code's); `fused`, the fused",
            "softmax (the softmax, which reads S and writes P anyway, verifies S and sums P, so",
            "those two reads go; the code on",
            "CUDA, where a sync-free check corrects a flagged S, redoes its P and",
            "tallies in one more launch, `softmax_correct_tally`, and on a CPU until commit",
            "a83ccd3); and `apart`, the code on a CPU since: every GEMM checked as by `kernels`,",
            "the fused softmax as the softmax, without a screen or a pass, on the steps that check",
            "the scores.",
            "The fused softmax also replaces Megatron's softmax, forward and backward, on the",
            "steps that check the scores or the context. Where the benchmark timed both softmaxes",
            "and what the fused softmax's screen of S and pass over P add (`softmax` in its JSON,",
            "runs 18 on), the model takes the softmax at those costs per element of S: the",
            "baseline's, the fused softmax's difference to it, and its checks. Elsewhere, the GPU",
            "profiles included, both run at the bandwidth and the fused softmax's checks cost",
            "nothing of their own.",
            "The unfused attention's backward pass is not protected (the flash path's is, below).",
            "",
            "On a GPU the launches weigh most below a few billion parameters: a clean check",
            f"launches {CHECK_KERNELS['kernels']} kernels (`CHECK_KERNELS`, as an H200 counted a",
            "sync-free check, the default where the kernels serve the GPU), each costing",
            "microseconds whatever its size. With",
            "`ABFTConfig.sync_free=False` a GPU also synchronises once per check, which the model",
            "does not count; nor does it count the host's time for each check (about 0.1 ms on",
            "the CPU host here: its ops, and 11 to 31 µs of Python around them; 60 µs an op",
            "on the H200's host; docs/benchmarks.md), which a GPU hides only while the host runs",
            "ahead of it. The calibrated profile of a GPU run prices each check op at what that",
            "run measured (`check_op`), so its validation rows count it.",
            "",
            *flash_method(),
            "",
            *flash_example(device),
            "",
            f"Device profile for the predictions: {device.name}, {device.notes}. Predictions for a",
            "device are only as good as the validation rows measured on it: a device with no row",
            "below has not been measured, and its figures are the model's alone.",
            "",
            "## Validation against measurements",
            "",
            "Each benchmark run is predicted with a profile calibrated from its own",
            "micro-benchmarks (matmul rate, elementwise bandwidth, op latency, the optimizer's",
            "bandwidth, the rate at which the kernels read the scores from memory, which",
            "prices the checks' bytes, what one dot product of the kernels' checksum products",
            "costs beyond its multiply-adds, and the softmaxes' costs) and from its unprotected",
            "steps:",
            "the baseline's forward and backward are scaled to what those took",
            "(`DeviceProfile.baseline_scale`; the `baseline step, roofline` rows give the",
            "roofline's own step beside the measured one). The checks are never scaled: their",
            "time is the model's count of their work at the micro-benchmarks' rates.",
            "That count is of the code as it is, not as it was when a run was made: the GPU",
            "runs' flash calls launched five kernels a layer more (the ledger's updates and",
            "the running sums, made since by the last programs of the kernels before them, and",
            "dQ's checksum tiles, made since in the backward's first launch), which their rows",
            "do not price.",
            "Tolerance: ±25% relative or ±1 percentage point, whichever is looser.",
            "Each measured overhead comes with the half-width of its 95% bootstrap interval",
            "over the run's repetitions (`bench_overhead.py`): a row whose prediction falls",
            "inside it agrees with the measurement as far as the measurement can tell. The",
            "`check` rows compare the time of one check of one layer, measured inside the",
            "training steps with every section checked (its pieces summed a step, shared over",
            "the layers, the median over the steps; with the fused softmax the pieces outside the",
            "guard's check too: the scores' references, and the context's from P's pass), with",
            "the model's `check_time` of that section's work: the model's own quantity, with",
            "none of the step's noise, judged at ±25%. The `checks' own time` row sums those",
            "times over the layers, as a share of the unprotected step, against the model's",
            "sum of the same (with the fused softmax, its screen, its pass and its difference to",
            "Megatron's softmax are not in it).",
            "",
            *validation,
            "",
            *summary(rows),
            "",
            "## Predictions",
            "",
            "The unfused attention by implementation, then the flash path. Every section checked",
            "every step, bf16, micro-batch 1. Sections are the extra time of that section alone",
            "over the baseline step; attention is all checks over the attention block's forward;",
            "step is all checks over the training step.",
            "",
            f"![overhead vs parameters]({os.path.relpath(args.plot, args.out.parent)})",
            "",
            *prediction_table(device),
            "",
            "### The flash path, predicted",
            "",
            f"On the {device.name}, every section checked every step, bf16, micro-batch 1, against",
            "the unprotected step with the flash attention. qkv and proj as the unfused",
            "attention's kernels check them; each flash section's own extra time (a section",
            "checked alone costs its own and `shared`); `shared`, what any flash section brings",
            "once a step; attention is all checks over the attention block's forward and",
            "backward (both hold flash checks); step is all checks over the training step.",
            "",
            *flash_table(device),
            "",
            "### Both attentions on every GPU profile",
            "",
            "Step overhead of every section checked every step, bf16: the unfused attention with",
            "the fused softmax (`fused`, against the unfused step) and the flash attention",
            "(predicted, against the flash step). `S a layer, unfused` is the scores one layer of",
            "the unfused attention holds on one rank (P, kept for the backward, as much again):",
            "what the flash attention never writes, and why it exists. The last column names the",
            "kind of work that takes most of the flash attention's checks' time on the",
            f"{device.name}.",
            "",
            *paths_table(device),
            "",
            "### The projections' checks against their GEMMs",
            "",
            *projections_text(device),
            "",
            *projections_table(device),
            "",
        ]
    )
