"""The speed tuner's pick against the job it tuned, outside the tuner: steady tokens/s alternated, then the whole job
wall clock; writes docs/benchmarks/tuner-<job>-<device>-<date>.md.

    python scripts/bench_tuner.py                          # the Shakespeare GPT recipe, tune.budget_minutes=8
    python scripts/bench_tuner.py --budget 4 --steps 200 --out /tmp/tuner.md
    python scripts/bench_tuner.py --tuned outputs/tune/speed/<date>_<time>   # skip the tuner, use its pick

1. ``python -m runner.tune speed --out <dir> <job> tune.budget_minutes=<budget>`` (its wall time, pick and notes);
2. the job and the job with the pick (``'+experiment=[<recipe>,tuned]' --config-dir <dir>``) alternated ``--repeats``
   times for ``--steps`` steps each without evaluation, each a fresh ``python -m runner`` process: tokens/s (warm-up
   left out), the pick's ratio per pair, their median and spread;
3. the whole job (``trainer.max_steps`` of the recipe, its evaluations included), recipe and pick alternated
   ``--whole-repeats`` times, each a fresh process after the tuner (the machine's compile cache as the tuner left
   it): wall clock of the process, the one-time costs of ``summary.json`` (``one_time``) and the median ratio.
The load average is recorded before and after each process: a busy machine changes every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
JOB = ["+experiment=shakespeare_char", "logger=none", "trainer.progress=off"]


def sh(cmd: list[str]) -> str:
    return " ".join(shlex.quote(c) for c in ["python", *cmd[1:]])


def process(cmd: list[str], log: Path) -> tuple[float, str, str]:
    """Run ``cmd`` from the repository; returns its wall seconds and the load averages before and after."""
    before = "%.2f" % os.getloadavg()[0]
    started = time.perf_counter()
    with log.open("w") as f:
        rc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        sys.exit(f"{sh(cmd)} exited {rc}; see {log}")
    return time.perf_counter() - started, before, "%.2f" % os.getloadavg()[0]


def job(folder: Path, tuned: Path | None, extra: list[str]) -> tuple[dict, float, str, str]:
    experiment = ["+experiment=[shakespeare_char,tuned]", "--config-dir", str(tuned)] if tuned else []
    cmd = [sys.executable, "-m", "runner", *JOB, *experiment, f"hydra.run.dir={folder}", *extra]
    wall, before, after = process(cmd, folder.with_suffix(".log"))
    return json.loads((folder / "summary.json").read_text()), wall, before, after


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=float, default=8.0, help="tune.budget_minutes")
    ap.add_argument("--steps", type=int, default=400, help="steps of each alternated run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--whole-repeats", type=int, default=3, help="pairs of whole jobs, alternated")
    ap.add_argument("--tuned", type=Path, help="a finished tuner folder: skip step 1")
    ap.add_argument("--work", type=Path, default=REPO / "outputs" / "bench_tuner")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d")
    out = a.out or REPO / "docs" / "benchmarks" / f"tuner-gpt-cpu-{stamp}.md"
    lines = [
        f"# The speed tuner on the Shakespeare GPT recipe ({stamp})",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores "
        f"({_cpu_model()}), Python {platform.python_version()}; command: `python scripts/bench_tuner.py "
        f"{' '.join(sys.argv[1:])}`.",
        "",
    ]
    tuned = a.tuned
    if tuned is None:
        tuned = a.work / f"tune-{time.strftime('%H%M%S')}"
        cmd = [
            sys.executable,
            "-m",
            "runner.tune",
            "speed",
            "--out",
            str(tuned),
            *JOB,
            f"tune.budget_minutes={a.budget:g}",
        ]
        wall, before, after = process(cmd, a.work / "tune.log")
        lines += ["## 1. The tuner", "", f"`{sh(cmd)}`: {wall / 60:.1f} min wall, load {before} -> {after}.", ""]
    result = json.loads((tuned / "speed.json").read_text())
    lines += [
        f"Pick: `{result['override']}` (objective {result.get('objective', 'throughput')}).",
        "",
        "Its notes:",
        "",
        *[f"- {n}" for n in result["notes"]],
        "",
        f"Its table: [{tuned.name}/speed.md]({tuned / 'speed.md'}) (not committed).",
        "",
    ]
    if result["override"] == "(no change)":
        out.write_text("\n".join(lines) + "\n")
        sys.exit(f"the tuner recommends no change: nothing to time against the job; {out}")
    pairs = []
    lines += [
        f"## 2. Steady tokens/s, alternated ({a.repeats} pairs of fresh processes, {a.steps} steps, no evaluation)",
        "",
        "| pair | recipe tokens/s | pick tokens/s | pick ÷ recipe | load before/after |",
        "|---|---|---|---|---|",
    ]
    short = [
        f"trainer.max_steps={a.steps}",
        "trainer.eval_every=null",
        "trainer.doctor=false",
        "checkpoint.at_end=false",
    ]
    for i in range(a.repeats):
        base, _, b0, b1 = job(a.work / f"recipe-{i}", None, short)
        pick, _, p0, p1 = job(a.work / f"pick-{i}", tuned, short)
        pairs.append(pick["tokens_per_sec"] / base["tokens_per_sec"])
        lines.append(
            f"| {i + 1} | {base['tokens_per_sec']:,.0f} | {pick['tokens_per_sec']:,.0f} | "
            f"×{pairs[-1]:.3f} | {b0}/{b1}, {p0}/{p1} |"
        )
    lines += [
        "",
        f"Median ×{statistics.median(pairs):.3f} (range ×{min(pairs):.3f}–×{max(pairs):.3f}).",
        "",
        f"## 3. The whole job (the recipe's steps and evaluations), wall clock of the process, {a.whole_repeats} "
        f"pairs alternated",
        "",
        "| pair | run | wall s | train s | eval s | start-up s | warm-up excess s | compile s | compile cache | "
        "val loss | load before/after |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ratios = []
    for i in range(a.whole_repeats):
        walls = {}
        for name, use in (("recipe", None), ("pick", tuned)):
            s, wall, before, after = job(a.work / f"whole-{name}-{i}", use, [])
            walls[name] = wall
            o = s["one_time"]
            lines.append(
                f"| {i + 1} | {name} | {wall:.1f} | {s['train_time_s']:.1f} | {s['eval_time_s']:.1f} | "
                f"{o['startup_s']:.1f} | {o['warmup_excess_s'] or 0:.1f} | {o['compile_s'] or 0:.1f} | "
                f"{o['compile_cache'].split(':')[0]} | {s.get('eval_loss', float('nan')):.4f} | "
                f"{before}/{after} |"
            )
        ratios.append(walls["recipe"] / walls["pick"])
    lines += [
        "",
        f"The recipe's job took {statistics.median(ratios):.2f}× as long as the pick's, median of "
        f"{len(ratios)} pairs (range {min(ratios):.2f}–{max(ratios):.2f}×).",
        "",
    ]
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())


def _cpu_model() -> str:
    try:
        return next(
            x.split(":", 1)[1].strip()
            for x in Path("/proc/cpuinfo").read_text().splitlines()
            if x.startswith("model name")
        )
    except (OSError, StopIteration):
        return "unknown CPU"


if __name__ == "__main__":
    main()
