"""make demo: a tiny GPT trains through a stream of soft errors on 2 CPU ranks, protected by ABFT.

1. tools/prepare_data.py turns the shipped text corpus (data/tiny_corpus) into a Megatron
   indexed dataset with a byte-level tokenizer;
2. pretrain_gpt.py --config configs/tiny_cpu.yaml runs on 2 gloo ranks (TP=2) with --abft and a
   seeded random fault every 3 steps, across sections, layers and ranks (progress shown);
3. the same run without faults, for the reference loss;
4. the same faults without ABFT, to show what they do to plain Megatron;
5. a summary table, and where the fault events (JSONL) and the W&B offline run are.

    python -m pretrain.demo [--steps 300] [--inject-every 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "out" / "demo"  # out/ is git-ignored, and `make clean` leaves it
CORPUS = OUT / "corpus" / "tiny_corpus"
SHOWN = re.compile(r"^(> |!!! )")
"""Lines of the training output the demo shows as they are; the full log is kept beside the
run. Megatron's iteration lines are shown shortened (``progress``)."""
PROGRESS = re.compile(
    r" iteration +(\d+)/ *(\d+) .*?elapsed time per iteration \(ms\): ([\d.]+) .*?"
    r"lm loss: (\S+) .*?abft injected/detected/corrected/uncorrectable: ([\d/]+)"
)


def progress(line: str) -> str | None:
    """Megatron's iteration line, shortened to fit the screen."""
    found = PROGRESS.match(line)
    if not found:
        return None
    step, total, ms, loss, faults = found.groups()
    return (
        f"step {int(step):>4}/{total}  lm loss {float(loss):.4f}  faults injected/detected/"
        f"corrected/uncorrectable {faults:<9} {float(ms):6.1f} ms/step"
    )


def torchrun(name: str, flags: list[str], show: bool) -> tuple[int, Path]:
    """Launch pretrain_gpt.py on 2 gloo ranks; stream the lines worth seeing when ``show``."""
    log = OUT / f"{name}.log"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "-m", "pretrain.pretrain_gpt",
        "--config", str(ROOT / "configs" / "tiny_cpu.yaml"),
        "--data-path", str(CORPUS), "--save", str(OUT / name), *flags,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    env.pop("WANDB_API_KEY", None)  # the demo's W&B run stays offline
    with open(log, "w") as sink:
        child = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for line in child.stdout:
            sink.write(line)
            shown = progress(line) or (line.rstrip() if SHOWN.match(line) else None)
            if show and shown:
                print("    " + shown, flush=True)
        return child.wait(), log


def summary_of(name: str) -> dict:
    return json.loads((OUT / name / "summary.json").read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps")
    parser.add_argument("--inject-every", type=int, default=3, help="steps between faults")
    args = parser.parse_args()
    start = time.perf_counter()
    for name in ("faulty", "clean", "unprotected"):
        shutil.rmtree(OUT / name, ignore_errors=True)
    OUT.mkdir(parents=True, exist_ok=True)
    steps = ["--train-iters", str(args.steps)]
    print(
        f"megatron-abft demo: a tiny GPT on 2 CPU ranks (TP=2), a soft error every "
        f"{args.inject_every} steps\n"
    )

    print("[1/4] corpus: data/tiny_corpus -> Megatron indexed dataset (byte-level)", flush=True)
    done = subprocess.run(
        [sys.executable, "-m", "tools.prepare_data", "--output-prefix", str(CORPUS),
         "--input", *map(str, sorted((ROOT / "data" / "tiny_corpus").glob("*.txt")))],
        cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    if done.returncode:
        print(done.stdout + done.stderr)
        return done.returncode
    print("    " + done.stdout.strip().splitlines()[-1])

    print(f"\n[2/4] training {args.steps} steps with --abft and injected faults", flush=True)
    code, log = torchrun(
        "faulty", [*steps, "--abft", "--abft-inject-every", str(args.inject_every)], show=True
    )
    if code:
        print(f"    the run failed (exit {code}); its log: {log}")
        return code
    faulty = summary_of("faulty")

    print("\n[3/4] the same run without faults (reference) ...", end=" ", flush=True)
    code, log = torchrun(
        "clean",
        [
            *steps,
            "--abft",
            "--abft-inject-every",
            "0",
            "--wandb-project",
            "",
            "--save-interval",
            str(args.steps),
        ],
        show=False,
    )
    if code:
        print(f"failed (exit {code}); its log: {log}")
        return code
    clean = summary_of("clean")
    print(f"final loss {clean['final_loss']:.6f}")

    print("[4/4] the same faults without ABFT (plain Megatron) ...", end=" ", flush=True)
    code, log = torchrun(
        "unprotected",
        [
            *steps,
            "--no-abft",
            "--abft-inject-every",
            str(args.inject_every),
            "--wandb-project",
            "",
            "--log-interval",
            "1",
            "--exit-interval",
            "60",
            "--save-interval",
            "1000",
        ],
        show=False,
    )
    without = describe_unprotected(code, log)
    print(without)

    print(table(faulty, clean, without))
    print(f"\nDemo done in {time.perf_counter() - start:.0f} s.")
    print(f"  fault events (JSONL): {os.path.relpath(faulty['events_file'], ROOT)}")
    if faulty["wandb_dir"]:
        wandb_dir = os.path.relpath(faulty["wandb_dir"], ROOT)
        print(f"  W&B offline run:      {wandb_dir}")
        print(f"                        (to upload: wandb sync {wandb_dir})")
    print(f"  logs and checkpoints: {os.path.relpath(OUT, ROOT)}/")
    return 0


def describe_unprotected(code: int, log: Path) -> str:
    """What the faults did to the unprotected run, from its log."""
    text = log.read_text()
    stopped = re.search(r"iteration (\d+): Unexpected result (\S+) \(message='([^']*)'", text)
    if code and stopped:
        step, value, _ = stopped.groups()
        return f"Megatron stops the job at iteration {step}: the loss is {value}"
    losses = re.findall(r"iteration +(\d+)/ *\d+ .*?lm loss: (\S+)", text)
    if not code and losses:
        step, loss = losses[-1]
        return f"ran {step} steps, loss {float(loss):.6f} (faults were silent)"
    return f"failed (exit {code}); its log: {log}"


def table(faulty: dict, clean: dict, without: str) -> str:
    events = [json.loads(line) for line in Path(faulty["events_file"]).read_text().splitlines()]
    by_section = Counter(e["section"] for e in events if e["action"] == "corrected")
    difference = abs(faulty["final_loss"] - clean["final_loss"])
    rows = [
        ("faults injected", faulty["faults_injected"]),
        ("faults detected", faulty["faults_detected"]),
        ("faults corrected in place", faulty["faults_corrected"]),
        ("faults uncorrectable", faulty["faults_uncorrectable"]),
        ("final loss with the faults", f"{faulty['final_loss']:.6f}"),
        ("final loss without faults", f"{clean['final_loss']:.6f}"),
        ("difference", f"{difference:.1e}"),
    ]
    width = max(len(name) for name, _ in rows)
    lines = ["", f"Summary: {faulty['iterations']} steps with ABFT", ""]
    lines += [f"  {name:<{width}}  {value:>12}" for name, value in rows]
    lines.append(
        "  corrected by section: " + ", ".join(f"{s} {n}" for s, n in sorted(by_section.items()))
    )
    lines.append(f"  without ABFT, the same faults: {without}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
