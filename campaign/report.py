"""The fault campaign's report: the markdown tables and their numbers, the figure, the
per-section vulnerabilities for the check-frequency optimizer (and the intervals it picks from
them), and the block of docs/fault-campaign.md they are written into."""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter, defaultdict
from pathlib import Path

from campaign.outcomes import OUTCOMES_OFF, OUTCOMES_ON, classify, read_number
from campaign.plan import (
    CHECKED_SECTION,
    CONFIG,
    CORRECTABLE_PATTERNS,
    DEFAULT_DOC,
    KINDS,
    PATTERNS,
    PROTECTED,
    SECTIONS,
    VULNERABILITY_KINDS,
    VULNERABILITY_SECTIONS,
    Settings,
    read_results,
    rel,
    settings_from_json,
)

BEGIN, END = "<!-- campaign:begin -->", "<!-- campaign:end -->"


def _share(hits: int, total: int) -> str:
    return f"{hits}/{total}" if total else "-"


def _percent(hits: int, total: int) -> str:
    return f"{100 * hits / total:.0f}% ({hits}/{total})" if total else "-"


def outcomes(trials: list[dict], mode: str, settings: Settings) -> list[str]:
    return [classify(t[mode], t["control"], settings.tolerance) for t in trials]


def rate_grid(trials: list[dict], mode: str, settings: Settings) -> dict:
    """{section: {kind: [non-trainable, trials]}}, with "all" rows and columns."""
    grid: dict = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for t in trials:
        for section in (t["section"], "all"):
            for kind in (t["kind"], "all"):
                cell = grid[section][kind]
                cell[0] += int(t[mode]["non_trainable"])
                cell[1] += 1
    return grid


def vulnerability(trials: list[dict]) -> tuple[dict, dict]:
    """P(non-trainable | a fault of class k in section s, protection off) from the 0d trials
    (a soft error corrupts one element of a GEMM output); q, k and v count as qkv. A class with
    no 0d trial falls back to the 0d/row/col trials, then to frequency.DEFAULT_VULNERABILITY.
    Returns (probabilities, {section: {class: (non-trainable, trials, basis)}})."""
    from megatron_abft.tuning.frequency import DEFAULT_VULNERABILITY

    tally: dict = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    wider: dict = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for t in trials:
        section = CHECKED_SECTION[t["section"]] if t["section"] != "probs" else None
        if section is None or t["pattern"] not in CORRECTABLE_PATTERNS:
            continue
        for table in (wider, tally) if t["pattern"] == "0d" else (wider,):
            table[section][t["class"]][0] += int(t["off"]["non_trainable"])
            table[section][t["class"]][1] += 1
    probabilities, basis = {}, {}
    for section in VULNERABILITY_SECTIONS:
        probabilities[section], basis[section] = {}, {}
        for kind in VULNERABILITY_KINDS:
            for name, table in (("0d", tally), ("0d/row/col", wider)):
                hits, total = table[section][kind]
                if total:
                    probabilities[section][kind] = round(hits / total, 4)
                    basis[section][kind] = (hits, total, name)
                    break
            else:
                probabilities[section][kind] = DEFAULT_VULNERABILITY[kind]
                basis[section][kind] = (None, 0, "default")
    return probabilities, basis


def optimizer_check(path: Path) -> dict:
    """Load the vulnerability file through the launch script's flags, as a run would, and ask
    the check-frequency optimizer for intervals (equal fault rates, 99% coverage, H100 costs)."""
    from megatron_abft.flags import coverage_intervals
    from pretrain import pretrain_gpt

    args = pretrain_gpt.parse_args(
        ["--config", str(CONFIG), "--mock-data", "--wandb-project", "", "--save", "",
         "--abft", "--abft-coverage-target", "0.99", "--abft-vulnerability", str(path)],
        world_size=2,
    )  # fmt: skip
    return coverage_intervals(args)


def _checks_ran_on(sessions: list[dict]) -> str:
    """Which kernels ran the checks and which softmax the attention used, as the sessions
    recorded them (nothing for sessions that predate the record)."""
    setups = sorted({(s["kernels"], s["softmax"]) for s in sessions if "kernels" in s})
    if not setups:
        return ""
    said = "; ".join(f"kernels: {kernels}, softmax: {softmax}" for kernels, softmax in setups)
    return f" Checks ran with {said}."


def tables(trials: list[dict], settings: Settings, sessions: list[dict], paths: dict) -> tuple:
    """The report's markdown and its numbers."""
    faulty = [t for t in trials if not t["control"]]
    controls = [t for t in trials if t["control"]]
    protected = [t for t in faulty if t["section"] in PROTECTED]
    probs = [t for t in faulty if t["section"] == "probs"]
    one_d = [t for t in protected if t["pattern"] in CORRECTABLE_PATTERNS]
    on = dict(zip((t["id"] for t in faulty), outcomes(faulty, "on", settings), strict=True))
    off = dict(zip((t["id"] for t in faulty), outcomes(faulty, "off", settings), strict=True))
    control_outcomes = Counter(outcomes(controls, "on", settings))
    sections = [s for s in SECTIONS if s in settings.sections]
    kinds = [k for k in KINDS if k in settings.kinds]
    patterns = [p for p in PATTERNS if p in settings.patterns]

    def count(group, table, *names):
        return sum(1 for t in group if table[t["id"]] in names)

    corrected = count(one_d, on, "corrected")
    masked = count(one_d, on, "masked")
    nt_on_1d = sum(t["on"]["non_trainable"] for t in one_d)
    not_corrected = [t for t in protected if on[t["id"]] != "corrected"]
    uncorrectable = [t for t in protected if t["on"]["uncorrectable"]]
    silent = count(protected, on, "silent", "miscorrected")
    elsewhere = sum(
        1 for t in protected if on[t["id"]] == "corrected" and t["on"]["flagged_elsewhere"]
    )
    control_detections = sum(t["on"]["detected"] for t in controls)
    control_deviation = max((read_number(t["on"]["loss_deviation"]) for t in controls), default=0.0)
    control_params = max((read_number(t["on"]["param_deviation"]) for t in controls), default=0.0)
    headline = {
        "corrected_0d_row_col": [corrected, len(one_d) - masked],
        "masked_0d_row_col": masked,
        "non_trainable_on_0d_row_col": [nt_on_1d, len(one_d)],
        "uncorrectable_reported": [len(uncorrectable), len(uncorrectable)],
        "silent_protected": [silent, len(protected)],
        "corrected_flagged_elsewhere": elsewhere,
        "control_detections": control_detections,
        "control_trials": len(controls),
        "control_max_loss_deviation": control_deviation,
        "control_max_param_deviation": control_params,
        "probs_silent": [count(probs, on, "silent"), len(probs)],
    }
    ok = {
        True: "yes",
        False: "**NO**",
    }
    lines = []
    add = lines.append
    wall = sum(s["wall_s"] for s in sessions)
    ran = sum(s["trials"] for s in sessions)
    workers = sorted({s["workers"] for s in sessions})
    add(
        f"{len(trials)} trials ({len(faulty)} with a fault, {len(controls)} clean controls), "
        f"each {settings.window} steps with protection off and on, from a snapshot after "
        f"{settings.warmup} warm-up steps, on {settings.windows} data windows; policy "
        f"`{settings.policy}` with protection on; effect tolerance {settings.tolerance:g} "
        f"(relative, on the loss and on the parameters). "
        + (
            f"Wall time {wall:.0f} s for {ran} trials ({wall / max(ran, 1):.2f} s per trial) "
            f"with {'/'.join(map(str, workers))} worker(s) of 2 ranks on "
            f"{sessions[-1]['cpus']} CPU cores"
            + (f", over {len(sessions)} sessions" if len(sessions) > 1 else "")
            + "."
            + _checks_ran_on(sessions)
            if sessions
            else ""
        )
    )
    add("")
    add("**What it shows** (protection on):")
    add("")
    add("| claim | measured | holds |")
    add("|---|---|---|")
    for pattern in [p for p in CORRECTABLE_PATTERNS if p in settings.patterns]:
        group = [t for t in one_d if t["pattern"] == pattern]
        fixed, quiet = count(group, on, "corrected"), count(group, on, "masked")
        others = Counter(f"{on[t['id']]} ({t['kind']})" for t in group
                         if on[t["id"]] not in ("corrected", "masked"))  # fmt: skip
        headline[f"corrected_{pattern}"] = [fixed, len(group) - quiet, quiet]
        text = f"{_share(fixed, len(group) - quiet)} detected ones corrected"
        if quiet:
            text += f"; {quiet} more below the detection limit changed nothing"
        if others:
            text += "; instead: " + ", ".join(f"{n} {what}" for what, n in sorted(others.items()))
        add(
            f"| {pattern} faults in protected sections are corrected in place | {text} | "
            f"{ok[not others]} |"
        )
    add(
        f"| none of them leaves training non-trainable | {_share(nt_on_1d, len(one_d))} "
        f"non-trainable | {ok[nt_on_1d == 0]} |"
    )
    add(
        f"| every fault not corrected in place is reported | {len(uncorrectable)} counted "
        f"uncorrectable, each handled by `{settings.policy}`; the "
        f"{len(not_corrected) - len(uncorrectable)} others were not detected and changed "
        f"nothing | {ok[silent == 0]} |"
    )
    add(
        f"| no silent corruption in protected sections (undetected or miscorrected faults that "
        f"changed training) | {_share(silent, len(protected))} | {ok[silent == 0]} |"
    )
    add(
        f"| a corrected fault leaves no trace in any other check | "
        f"{elsewhere} corrected trials with flags elsewhere | {ok[elsewhere == 0]} |"
    )
    add(
        f"| no detection in clean controls | {control_detections} detections in "
        f"{len(controls)} trials of {settings.window} steps (every check of every layer and "
        f"rank); largest deviation from the unprotected run: loss {control_deviation:.1e}, "
        f"parameters {control_params:.1e} | "
        f"{ok[control_detections == 0]} |"
    )
    probs_silent = count(probs, on, "silent")
    add(
        f"| probs (softmax output, the blind spot) | silent corruption in "
        f"{_percent(probs_silent, len(probs))}; {count(probs, on, 'reported')} reported (a "
        f"non-finite P makes the context checksums non-finite), "
        f"{count(probs, on, 'masked')} without effect | documented |"
    )
    add("")

    def grid_table(mode: str, title: str) -> None:
        grid = rate_grid(faulty, mode, settings)
        add(f"**{title}**: non-trainable trials / trials, by section and kind.")
        add("")
        add("| section | " + " | ".join(k.replace("_", " ") for k in kinds) + " | all |")
        add("|---" * (len(kinds) + 2) + "|")
        for section in [*sections, "all"]:
            cells = [_share(*grid[section][k]) for k in kinds]
            add(
                f"| {'**all**' if section == 'all' else section} | " + " | ".join(cells)
                + f" | {_percent(*grid[section]['all'])} |"
            )  # fmt: skip
        add("")

    grid_table("off", "Protection off (ATTNChecker's study, on Megatron-core)")
    grid_table("on", "Protection on")

    add(
        "**Outcomes by section**. Off: non-trainable, deviated (finite but the loss or the "
        "parameters moved beyond the tolerance), no effect. On: corrected in place, reported "
        "uncorrectable (the policy skipped the step), undetected without effect, silent."
    )
    add("")
    add(
        "| section | trials | off: non-trainable | off: deviated | off: no effect | "
        "on: corrected | on: reported | on: undetected, no effect | on: silent |"
    )
    add("|---" * 9 + "|")
    by_section = {}
    for section in [*sections, "all"]:
        group = [t for t in faulty if section in ("all", t["section"])]
        row = {
            "trials": len(group),
            **{f"off_{o}": count(group, off, o) for o in OUTCOMES_OFF},
            **{f"on_{o}": count(group, on, o) for o in OUTCOMES_ON},
        }
        by_section[section] = row
        n = len(group)
        add(
            f"| {section} | {n} | {_percent(row['off_non_trainable'], n)} | "
            f"{_percent(row['off_deviated'], n)} | {_percent(row['off_masked'], n)} | "
            f"{_percent(row['on_corrected'], n)} | {_percent(row['on_reported'], n)} | "
            f"{_percent(row['on_masked'], n)} | "
            f"{_percent(row['on_silent'] + row['on_miscorrected'], n)} |"
        )
    add("")

    add("**Coverage by pattern**, protected sections (probs left out), protection on.")
    add("")
    add("| pattern | trials | corrected | reported | undetected, no effect | silent | "
        "off: non-trainable |")  # fmt: skip
    add("|---" * 7 + "|")
    for pattern in patterns:
        group = [t for t in protected if t["pattern"] == pattern]
        n = len(group)
        add(
            f"| {pattern} | {n} | {_percent(count(group, on, 'corrected'), n)} | "
            f"{_percent(count(group, on, 'reported'), n)} | "
            f"{_percent(count(group, on, 'masked'), n)} | "
            f"{_percent(count(group, on, 'silent', 'miscorrected'), n)} | "
            f"{_percent(count(group, off, 'non_trainable'), n)} |"
        )
    add("")

    flips = [t for t in faulty if t["kind"] == "bitflip"]
    if flips:
        add(
            "**Random bit flips by bit** (fp32: sign 31, exponent 23-30, mantissa 0-22), all "
            "sections."
        )
        add("")
        add("| bits | trials | off: non-trainable | off: no effect | on: detected | "
            "on: undetected, no effect | on: silent |")  # fmt: skip
        add("|---" * 7 + "|")
        for name, bits in (("sign (31)", {31}), ("top exponent (30)", {30}),
                           ("exponent (23-29)", set(range(23, 30))),
                           ("mantissa (0-22)", set(range(23)))):  # fmt: skip
            group = [t for t in flips if t["bit"] in bits]
            n = len(group)
            detected = sum(1 for t in group if t["on"]["detected"])
            add(
                f"| {name} | {n} | {_percent(count(group, off, 'non_trainable'), n)} | "
                f"{_percent(count(group, off, 'masked'), n)} | {_percent(detected, n)} | "
                f"{_percent(count(group, on, 'masked'), n)} | "
                f"{_percent(count(group, on, 'silent', 'miscorrected'), n)} |"
            )
        add("")

    probabilities, basis = vulnerability(faulty)
    add(
        "**Vulnerability** for the check-frequency optimizer: P(non-trainable | one fault of "
        "that class in that section, protection off), from the 0d trials (q, k and v count as "
        "qkv). Classes as `megatron_abft.check.eec.KINDS`: INF and -INF are `inf`; finite values "
        "below 1e10 are `finite`; a bit flip is the class the checks measured for it (the worst "
        "kind detected in its section), `finite` when it was too small to detect. "
        f"Written to `{paths['vulnerability']}`."
    )
    add("")
    add("| section | " + " | ".join(VULNERABILITY_KINDS) + " |")
    add("|---" * (len(VULNERABILITY_KINDS) + 1) + "|")
    for section in VULNERABILITY_SECTIONS:
        cells = []
        for kind in VULNERABILITY_KINDS:
            hits, total, name = basis[section][kind]
            p = probabilities[section][kind]
            cells.append(
                f"{p:.2f} ({hits}/{total})" if name == "0d"
                else f"{p:.2f} ({hits}/{total}, {name})" if total
                else f"{p:.2f} (no trials: default)"
            )  # fmt: skip
        add(f"| {section} | " + " | ".join(cells) + " |")
    add("")
    numbers = {
        "headline": headline,
        "by_section": by_section,
        "non_trainable_off": _plain(rate_grid(faulty, "off", settings)),
        "non_trainable_on": _plain(rate_grid(faulty, "on", settings)),
        "controls": dict(control_outcomes),
        "vulnerability": probabilities,
        "wall_seconds": wall,
        "trials": len(trials),
    }
    return "\n".join(lines), numbers


def _plain(grid: dict) -> dict:
    return {s: {k: list(v) for k, v in row.items()} for s, row in grid.items()}


def figure(trials: list[dict], settings: Settings, path: Path) -> None:
    """Protection off: the non-trainable rate and the rate of any effect, by section and kind;
    protection on: what happened to the faults of each section."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    faulty = [t for t in trials if not t["control"]]
    sections = [s for s in SECTIONS if s in settings.sections]
    kinds = [k for k in KINDS if k in settings.kinds]
    off = {t["id"]: o for t, o in zip(faulty, outcomes(faulty, "off", settings), strict=True)}
    fig, axes = plt.subplots(1, 3, figsize=(17, 5), layout="constrained")
    panels = (
        (axes[0], ("non_trainable",), "protection off: non-trainable"),
        (axes[1], ("non_trainable", "deviated"), "protection off: non-trainable or deviated"),
    )
    for ax, hits, title in panels:
        rates = np.full((len(sections), len(kinds)), np.nan)
        for i, s in enumerate(sections):
            for j, k in enumerate(kinds):
                group = [t for t in faulty if t["section"] == s and t["kind"] == k]
                if group:
                    n = sum(off[t["id"]] in hits for t in group)
                    rates[i, j] = n / len(group)
                    ax.text(j, i, f"{n}/{len(group)}", ha="center", va="center", fontsize=7,
                            color="white" if n / len(group) > 0.6 else "black")  # fmt: skip
        image = ax.imshow(rates, vmin=0, vmax=1, cmap="Reds")
        ax.set_xticks(range(len(kinds)), [k.replace("value_", "±") for k in kinds], rotation=40)
        ax.set_yticks(range(len(sections)), sections)
        ax.set_title(title)
    fig.colorbar(image, ax=axes[:2], fraction=0.03, label="share of trials")
    ax = axes[2]
    colours = {"corrected": "#2a9d8f", "reported": "#e9c46a", "masked": "#bbbbbb",
               "silent": "#e63946", "miscorrected": "#6d0000"}  # fmt: skip
    left = np.zeros(len(sections))
    shares = {o: [] for o in colours}
    for s in sections:
        group = [t for t in faulty if t["section"] == s]
        found = Counter(outcomes(group, "on", settings))
        for o in colours:
            shares[o].append(found[o] / max(len(group), 1))
    for o, colour in colours.items():
        label = "undetected, no effect" if o == "masked" else o
        ax.barh(sections, shares[o], left=left, color=colour, label=label)
        left += np.array(shares[o])
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of trials")
    stuck = sum(t["on"]["non_trainable"] for t in faulty)
    ax.set_title(f"protection on: outcome (non-trainable: {stuck}/{len(faulty)})")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def replace_block(doc: Path, begin: str, end: str, body: str) -> None:
    """Put ``body`` between the markers of ``doc`` (appended, with markers, if they are absent)."""
    text = doc.read_text() if doc.exists() else ""
    block = f"{begin}\n{body.rstrip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + ("\n\n" if text else "") + block + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)


def write_report(results: Path, args: argparse.Namespace, command: str) -> dict:
    """Tables (markdown block in --doc), figure, vulnerability JSON and summary JSON; they name
    ``command`` as their maker."""
    header, trials, sessions = read_results(results)
    settings = settings_from_json(header)
    trials = sorted(trials, key=lambda t: t["id"])
    if not trials:
        print(f"{results}: no trials yet")
        return {}
    paths = {"vulnerability": rel(args.vulnerability) if args.vulnerability else "(not written)"}
    markdown, numbers = tables(trials, settings, sessions, paths)
    if args.vulnerability:
        path = Path(args.vulnerability)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(numbers["vulnerability"], indent=1) + "\n")
        numbers["optimizer_intervals"] = optimizer_check(path)
        chosen = ", ".join(f"{s} {'off' if n is None else f'every {n}'}"
                           for s, n in numbers["optimizer_intervals"].items())  # fmt: skip
        markdown += (
            f"\nLoaded by the launch script (`--abft-coverage-target 0.99 --abft-vulnerability "
            f"{rel(path)}`, equal fault rates, H100 check costs, the tiny model's shape), the "
            f"optimizer checks: {chosen}.\n"
        )
    markdown += f"\nMade by `{command}` (results: `{rel(results)}`).\n"
    if args.figure:
        figure(trials, settings, Path(args.figure))
        where = os.path.relpath(args.figure, Path(args.doc or DEFAULT_DOC).parent)
        markdown += f"\n![fault campaign]({where})\n"
    if args.summary:
        Path(args.summary).write_text(json.dumps(numbers, indent=1) + "\n")
    if args.doc:
        replace_block(Path(args.doc), BEGIN, END, markdown)
    print(markdown)
    return numbers
