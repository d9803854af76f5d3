"""What pruning buys the recipe search: the same search with and without a pruner, side by side, one core each;
writes docs/benchmarks/search-pruning-cpu-<date>.md.

    python scripts/bench_search_pruning.py                        # hparams_search=mnist_optuna, ~1 hour
    python scripts/bench_search_pruning.py --pruner hyperband     # another pruner
    python scripts/bench_search_pruning.py --report PRUNED NONE   # the page from two finished sweep folders

Both searches run at once, each pinned to its own core (``taskset``) with one intra-op thread, so they share the
machine's state for the whole hour instead of meeting different loads an hour apart. Each is
``python -m runner hparams_search=<search> hydra.sweeper.n_jobs=2 hydra.sweeper.pruner=<pruner|none>``, its trials
and its verification on fresh seeds included; ``bench.json`` in each sweep folder keeps the command and its wall
time. The page compares wall time (machine-dependent), and the training steps, samples and evaluations the trials
spent (which are not).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


def run_both(search: str, pruner: str, work: Path) -> dict[str, Path]:
    """Start the two searches at once, pinned to cores 0 and 1; wait for both. Their sweep folders by pruner."""
    folders, procs = {}, {}
    for core, name in enumerate((pruner, "none")):
        folder = work / name
        cmd = [
            sys.executable,
            "-m",
            "runner",
            f"hparams_search={search}",
            "hydra.sweeper.n_jobs=2",
            f"hydra.sweeper.pruner={name}",
            "logger=none",
            "trainer.num_threads=1",
            f"hydra.sweep.dir={folder}",
        ]
        log = open(work / f"{name}.log", "w")  # noqa: SIM115 - closed with the process below
        procs[name] = (
            subprocess.Popen(
                ["taskset", "-c", str(core), *cmd],
                cwd=REPO,
                stdout=log,
                stderr=log,
                env={**os.environ, "WANDB_MODE": "disabled"},
            ),
            time.time(),
            cmd,
            log,
        )
        folders[name] = folder
    for name, (proc, started, cmd, log) in procs.items():
        rc = proc.wait()
        log.close()
        if rc != 0:
            sys.exit(f"failed ({rc}): {' '.join(cmd)}; see {work / f'{name}.log'}")
        (folders[name] / "bench.json").write_text(
            json.dumps(
                {
                    "command": "python -m runner " + " ".join(cmd[3:]),
                    "wall_s": time.time() - started,
                    "load": os.getloadavg()[0],
                }
            )
        )
    return folders


def trials(sweep: Path) -> list[dict]:
    """One row per trial folder: its overrides, how it ended, its steps, samples and seconds."""
    rows = []
    for folder in sorted((p for p in sweep.iterdir() if p.name.isdigit()), key=lambda p: int(p.name)):
        summary = json.loads((folder / "summary.json").read_text())
        overrides = yaml.safe_load((folder / ".hydra" / "overrides.yaml").read_text())
        searched = [o for o in overrides if not o.startswith(("hparams_search=", "logger=", "trainer.num_threads="))]
        ended = str(summary.get("stopped_early") or "its limit")
        rows.append(
            {
                "trial": int(folder.name),
                "params": " ".join(searched),
                "steps": summary["steps"],
                "samples": summary["steps"] * summary["global_batch_size"],
                "train_s": summary["train_time_s"],
                "eval_s": summary["eval_time_s"],
                "ended": "pruned"
                if ended.startswith("pruned")
                else "target"
                if ended.startswith("reached")
                else "its limit",
                "time_to_target_s": summary.get("time_to_target_s"),
            }
        )
    return rows


def section(name: str, sweep: Path) -> tuple[list[str], dict]:
    bench = json.loads((sweep / "bench.json").read_text())
    rows = trials(sweep)
    results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    totals = {
        "wall_s": bench["wall_s"],
        "steps": sum(r["steps"] for r in rows),
        "samples": sum(r["samples"] for r in rows),
        "train_s": sum(r["train_s"] for r in rows),
        "eval_s": sum(r["eval_s"] for r in rows),
        "pruned": sum(r["ended"] == "pruned" for r in rows),
        "best": results.get("best_params"),
        "verification": results.get("verification"),
    }
    load = f", load average {bench['load']:.2f} at its end" if bench.get("load") is not None else ""
    lines = [
        f"## pruner={name}",
        "",
        f"`{bench['command']}`: {bench['wall_s'] / 60:.1f} min wall (verification included){load}.",
        "",
        "| trial | searched | ended at | steps | samples | train s | eval s | time to target s |",
        "|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ttt = f"{r['time_to_target_s']:.1f}" if r["time_to_target_s"] is not None else "–"
        lines.append(
            f"| {r['trial']} | `{r['params']}` | {r['ended']} | {r['steps']:,} | {r['samples']:,} | "
            f"{r['train_s']:.1f} | {r['eval_s']:.1f} | {ttt} |"
        )
    lines += [
        "",
        f"Trials: {len(rows)}, pruned {totals['pruned']}; {totals['steps']:,} steps, "
        f"{totals['samples']:,} samples, {totals['train_s'] / 60:.1f} min training and "
        f"{totals['eval_s'] / 60:.1f} min evaluating.",
        "",
        f"Best: `{totals['best']}`.",
        "",
        "Verification (optimization_results.yaml):",
        "",
        "```yaml",
        yaml.safe_dump(totals["verification"], sort_keys=False).rstrip(),
        "```",
        "",
    ]
    return lines, totals


def write(pruner: str, folders: dict[str, Path], out: Path, search: str) -> None:
    sys.path.insert(0, str(REPO))
    import torch

    from runner.measure import hardware

    parts, totals = {}, {}
    for name, folder in folders.items():
        parts[name], totals[name] = section(name, folder)
    p, n = totals[pruner], totals["none"]
    lines = [
        f"# The recipe search with and without pruning ({time.strftime('%Y-%m-%d')})",
        "",
        f"Machine: {os.cpu_count()} cores ({hardware.device_name(torch.device('cpu'))}), torch "
        f"{torch.__version__}; command: `python scripts/bench_search_pruning.py --search {search} --pruner "
        f"{pruner}`: the two searches at once, each pinned to one core, one intra-op thread.",
        "",
        "| | wall min | trials pruned | steps | samples | training min | evaluating min |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in (pruner, "none"):
        t = totals[name]
        lines.append(
            f"| pruner={name} | {t['wall_s'] / 60:.1f} | {t['pruned']} | {t['steps']:,} | {t['samples']:,} | "
            f"{t['train_s'] / 60:.1f} | {t['eval_s'] / 60:.1f} |"
        )
    lines += [
        "",
        f"With pruner={pruner} the search took ×{p['wall_s'] / n['wall_s']:.2f} the wall time of the same "
        f"search without one, ×{p['samples'] / n['samples']:.2f} its training samples and "
        f"×{(p['train_s'] + p['eval_s']) / (n['train_s'] + n['eval_s']):.2f} its training and evaluation "
        f"seconds.",
        "",
        *parts[pruner],
        *parts["none"],
    ]
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--search", default="mnist_optuna", help="a conf/hparams_search/ file")
    ap.add_argument("--pruner", default="median", help="hydra.sweeper.pruner of the pruned search")
    ap.add_argument(
        "--report",
        nargs=2,
        type=Path,
        metavar=("PRUNED", "NONE"),
        help="write the page from two finished sweep folders (each with its bench.json)",
    )
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    out = a.out or REPO / "docs" / "benchmarks" / f"search-pruning-cpu-{time.strftime('%Y-%m-%d')}.md"
    if a.report:
        write(a.pruner, {a.pruner: a.report[0], "none": a.report[1]}, out, a.search)
        return
    with tempfile.TemporaryDirectory() as tmp:
        write(a.pruner, run_both(a.search, a.pruner, Path(tmp)), out, a.search)


if __name__ == "__main__":
    main()
