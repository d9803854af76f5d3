"""The recipe search without a barrier: how busy its slots were and what share of its wall time the verification
took; writes docs/benchmarks/search-slots-cpu-<date>.md.

    python scripts/bench_search_slots.py                  # hparams_search=mnist_optuna n_jobs=2 pruner=median, ~20 min
    python scripts/bench_search_slots.py --report SWEEP   # the page from a finished sweep folder

Runs ``python -m runner hparams_search=<search> hydra.sweeper.n_jobs=2 hydra.sweeper.pruner=median logger=none``
(the command of issue 58's done-when, nothing else added: each slot's trials get the CPUs shared out) alone on the
machine. The figures are the search's own (``optimization_results.yaml``: ``wall``, ``verification``) and, from the
trial folders, how many trials ran at each moment of the trials' phase.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


def run(search: str, sweep: Path) -> None:
    """Run the search into ``sweep`` (its console in ``<sweep>.log``); ``bench.json`` keeps command, wall, load."""
    cmd = [
        sys.executable,
        "-m",
        "runner",
        f"hparams_search={search}",
        "hydra.sweeper.n_jobs=2",
        "hydra.sweeper.pruner=median",
        "logger=none",
        f"hydra.sweep.dir={sweep}",
    ]
    load, started = os.getloadavg()[0], time.time()
    with open(f"{sweep}.log", "w") as log:
        rc = subprocess.call(
            cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "WANDB_MODE": "disabled"}
        )
    if rc != 0:
        sys.exit(f"failed ({rc}): {' '.join(cmd)}; see {sweep}.log")
    (sweep / "bench.json").write_text(
        json.dumps(
            {"command": "python -m runner " + " ".join(cmd[3:-1]), "wall_s": time.time() - started, "load_before": load}
        )
    )


def running_at_once(sweep: Path) -> dict[int, float]:
    """Seconds of the trials' phase (to the last trial's end) during which 0, 1, 2... jobs ran, trials and the
    verification's runs started ahead alike: each job from its ``.hydra/config.yaml`` (written as it starts) to
    its last file written."""
    spans = []
    for folder in [*(p for p in sweep.iterdir() if p.name.isdigit()), *sweep.glob("verify/*/seed*")]:
        start = folder / ".hydra" / "config.yaml"
        if start.is_file():
            spans.append(
                (
                    start.stat().st_mtime,
                    max(p.stat().st_mtime for p in folder.rglob("*") if p.is_file()),
                    folder.name.isdigit(),
                )
            )
    phase = max(b for _, b, trial in spans if trial)
    spans = [(a, min(b, phase)) for a, b, _ in spans if a < phase]
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    out: dict[int, float] = {}
    level, last = 0, None
    for t, step in events:
        if last is not None:
            out[level] = out.get(level, 0.0) + t - last
        level, last = level + step, t
    return out


def write(sweep: Path, out: Path, search: str) -> None:
    bench = json.loads((sweep / "bench.json").read_text())
    results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    wall, v = results["wall"], results["verification"]
    at_once = running_at_once(sweep)
    phase = sum(at_once.values())
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    day = time.strftime("%Y-%m-%d")
    share = {k: wall[k] / wall["total_s"] for k in ("trials_s", "verification_s")}
    lines = [
        f"# The recipe search without a barrier, and a verification that stops when firm ({day})",
        "",
        f"Machine: {os.cpu_count()} cores ({cpu}), alone (load {bench['load_before']:.2f} before it); each "
        "slot's trials with trainer.num_threads=1 (the CPUs shared out by the search). Command: "
        f"`{bench['command']}`; the page: `python scripts/bench_search_slots.py --report <sweep>`.",
        "",
        "| | minutes | share |",
        "|---|---:|---:|",
        f"| the search (wall) | {bench['wall_s'] / 60:.1f} | |",
        f"| its trials | {wall['trials_s'] / 60:.1f} | {share['trials_s']:.0%} |",
        f"| its verification | {wall['verification_s'] / 60:.1f} | {share['verification_s']:.0%} |",
        "",
        f"Slots busy {wall['slots_busy']:.1%} of the trials' slot-time (idle {1 - wall['slots_busy']:.1%})."
        " Trials running at once over the trials' phase (from the job folders' times): "
        + ", ".join(f"{n}: {s / phase:.1%}" for n, s in sorted(at_once.items()))
        + ".",
        "",
        f"Verification: {v.get('stopped')}, each look at {v.get('look_confidence', 0):.2%}; time to target, "
        f"best / start: {_interval(v.get('time_to_target'))} (the stopping rule); samples to target: "
        f"{_interval(v.get('samples_to_target'))}.",
        "",
        f"Best: `{results['best_params']}`; the line to paste: `{results['command']}`.",
        "",
        *run_table(sweep),
    ]
    out.write_text("\n".join(lines))
    print(f"wrote {out}")


def run_table(sweep: Path) -> list[str]:
    """Each verification run's time and samples to target, and its seconds training and evaluating
    (``verify/<side>/seed<N>/summary.json``)."""
    lines = [
        "Per verification run (`verify/<side>/seed<N>/summary.json`):",
        "",
        "| run | time to target s | samples to target | training s | evaluating s |",
        "|---|---:|---:|---:|---:|",
    ]
    for path in sorted((sweep / "verify").glob("*/seed*/summary.json")):
        s = json.loads(path.read_text())
        to_target = s.get("time_to_target_s")
        lines.append(
            f"| {path.parent.parent.name}, {path.parent.name.replace('seed', 'seed ')} | "
            + (f"{to_target:.1f}" if to_target is not None else "missed")
            + f" | {s.get('samples_to_target') or 0:,} | {s['train_time_s']:.1f} | {s['eval_time_s']:.1f} |"
        )
    return [*lines, ""]


def _interval(r: dict | float | None) -> str:
    if r is None or isinstance(r, (int, float)):
        return str(r)
    return f"×{r['estimate']:.3g} [{r['low']:.3g}, {r['high']:.3g}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--search", default="mnist_optuna", help="a conf/hparams_search/ file")
    ap.add_argument("--report", type=Path, metavar="SWEEP", help="write the page from this finished sweep folder")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    out = args.out or REPO / "docs" / "benchmarks" / f"search-slots-cpu-{time.strftime('%Y-%m-%d')}.md"
    sweep = args.report
    if sweep is None:
        sweep = Path("/tmp") / f"search-slots-{time.strftime('%H%M%S')}"
        run(args.search, sweep)
    write(sweep.resolve(), out, args.search)


if __name__ == "__main__":
    main()
