"""nanoGPT's character-level Shakespeare through runner: the recipe, then the same recipe with the fast
preset's switches layered on, one after the other on this machine; writes docs/benchmarks/gpt-<device>.md and its
loss-curve plot.

    python scripts/bench_gpt.py                                  # CPU: +experiment=shakespeare_char
    python scripts/bench_gpt.py --preset shakespeare_char_gpu    # GPU: nanoGPT's GPU configuration
    python scripts/bench_gpt.py --steps 200 --out /tmp/gpt.md    # a shorter try
    python scripts/bench_gpt.py --tuned outputs/tune/speed/<date>_<time>   # and the speed tuner's pick

With ``--tuned DIR`` (a ``python -m runner.tune speed`` folder, which holds ``experiment/tuned.yaml``) two more
runs follow: the recipe with the pick (``'+experiment=[<recipe>,tuned]' --config-dir DIR``), and the same with
evaluation at nanoGPT's cost (``trainer.eval_max_batches=20``: 20 batches per evaluation, as its
``--eval_iters=20``), whose wall time is comparable with nanoGPT's own ``train.py``.

Each run is a plain ``python -m runner`` process (``logger=none``); the figures come from its
``summary.json`` and ``metrics.jsonl``: validation loss, time to the preset's ``trainer.target_loss``
(training time until the first evaluation at or below it, evaluations excluded), tokens/s (warm-up
excluded), step time, wall time of the whole process. The machine's load average is recorded before and
after each run, since a busy machine changes every speed figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run(name: str, experiment: str, extra: list[str], folder: Path, config_dir: Path | None = None) -> dict:
    search = ["--config-dir", str(config_dir)] if config_dir else []
    cmd = [
        sys.executable,
        "-m",
        "runner",
        *search,
        f"+experiment={experiment}",
        "logger=none",
        "trainer.progress=lines",
        f"hydra.run.dir={folder}",
        *extra,
    ]
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        sys.exit(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    summary = json.loads((folder / "summary.json").read_text())
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    shown = " ".join(shlex.quote(c) for c in ["python", "-m", "runner", *cmd[3 : -1 - len(extra)], *extra])
    if config_dir:
        shown = shown.replace(shlex.quote(str(config_dir)), "<tuned>")
    return {
        "name": name,
        "command": shown,
        "summary": summary,
        "rows": rows,
        "wall_s": wall,
        "load": (load_before, os.getloadavg()[0]),
        "samples": (folder / "samples.txt").read_text()[:300],
    }


def plot(results: list[dict], target: float | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        train = [(x["step"], x["loss"]) for x in r["rows"] if x.get("loss") is not None]
        val = [(x["step"], x["eval_loss"]) for x in r["rows"] if x.get("eval_loss") is not None]
        (line,) = ax.plot(*zip(*train), alpha=0.5, label=f"{r['name']}: train")
        ax.plot(*zip(*val), "o-", color=line.get_color(), label=f"{r['name']}: validation")
    if target:
        ax.axhline(target, color="grey", ls="--", lw=1, label=f"target {target}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats per character)")
    ax.set_ylim(top=3.0)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def fmt(v, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="shakespeare_char", help="the recipe: an experiment preset")
    p.add_argument("--steps", type=int, default=None, help="override trainer.max_steps (default: the preset's)")
    p.add_argument("--out", type=Path, default=None, help="the report (default docs/benchmarks/gpt-<cpu|gpu>.md)")
    p.add_argument(
        "--tuned",
        type=Path,
        default=None,
        help="a python -m runner.tune speed folder: also run the recipe with its experiment/tuned.yaml",
    )
    p.add_argument("overrides", nargs="*", help="extra overrides for every run, e.g. data.path=...")
    args = p.parse_args()
    gpu = "gpu" in args.preset
    out = args.out or REPO / "docs" / "benchmarks" / f"gpt-{'gpu' if gpu else 'cpu'}.md"
    extra = [*args.overrides, *([f"trainer.max_steps={args.steps}"] if args.steps else [])]
    scratch = REPO / "outputs" / "bench_gpt" / time.strftime("%Y-%m-%d_%H-%M-%S")
    results = [
        run("recipe", args.preset, extra, scratch / "recipe"),
        run("recipe + fast", f"[fast,{args.preset}]", extra, scratch / "fast"),
    ]
    if args.tuned:
        tuned = args.tuned.resolve()
        if not (tuned / "experiment" / "tuned.yaml").is_file():
            sys.exit(f"--tuned {args.tuned}: no experiment/tuned.yaml there; give a python -m runner.tune speed folder")
        results += [
            run("recipe + tuned", f"[{args.preset},tuned]", extra, scratch / "tuned", tuned),
            run(
                "recipe + tuned, 20 eval batches",
                f"[{args.preset},tuned]",
                [*extra, "trainer.eval_max_batches=20"],
                scratch / "tuned-eval20",
                tuned,
            ),
        ]
    target = results[0]["summary"]["config"]["trainer"]["target_loss"]
    image = out.with_suffix(".png")
    plot(results, target, image)
    s0 = results[0]["summary"]
    lines = [
        f"# nanoGPT's character-level Shakespeare through runner ({'GPU' if gpu else 'CPU'})",
        "",
        f"Machine: {s0['device_name']} ({os.cpu_count()} cores); torch {s0['torch_version']}; Python "
        f"{platform.python_version()}; runner {s0['git_sha']}.",
        "",
        f"Command: `python scripts/bench_gpt.py {' '.join(sys.argv[1:])}`".replace("  ", " ").rstrip() + " — it runs "
        f"the {len(results)} jobs below one after the other and writes this file.",
        "",
        "| run | command | validation loss | time to val. loss "
        f"{target} | tokens/s | step time (median, ms) | peak memory (MiB) | wall time (s) "
        "| load average before/after |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        s = r["summary"]
        lines.append(
            f"| {r['name']} | `{r['command']}` | {fmt(s['eval_loss'], '.4f')} | {fmt(s['time_to_target_s'], '.1f')} s "
            f"| {fmt(s['tokens_per_sec'], ',.0f')} | {fmt(s['step_time_ms_median'], '.1f')} | "
            f"{fmt(s['peak_memory_mb'], ',.0f')} | {r['wall_s']:.0f} | {r['load'][0]:.1f} / {r['load'][1]:.1f} |"
        )
    fast = results[1]["summary"]
    t0, t1 = s0["time_to_target_s"], fast["time_to_target_s"]
    for r in results[2:3]:
        s2 = r["summary"]
        lines += [
            "",
            f"Speed-up of the tuned switches ({r['name']}): tokens/s "
            f"×{s2['tokens_per_sec'] / s0['tokens_per_sec']:.2f}, "
            f"median step time ×{s0['step_time_ms_median'] / s2['step_time_ms_median']:.2f}; validation loss "
            f"{s2['eval_loss']:.4f} vs the recipe's {s0['eval_loss']:.4f} "
            f"({s2['eval_loss'] - s0['eval_loss']:+.4f}).",
        ]
    lines += [
        "",
        f"![loss curves]({image.name})",
        "",
        f"Speed-up of the fast switches: tokens/s ×{fast['tokens_per_sec'] / s0['tokens_per_sec']:.2f}, median step "
        f"time ×{s0['step_time_ms_median'] / fast['step_time_ms_median']:.2f}"
        + (
            f", time to validation loss {target} ×{t0 / t1:.2f}."
            if t0 and t1
            else f". Validation loss {target} was not reached by "
            f"{'either run' if not (t0 or t1) else 'one of the runs'}, so there is no time-to-target ratio."
        ),
        "",
        "What the fast preset switched on for this model (summary.json `techniques`):",
        "",
        *[f"- `{k}`: {v}" for k, v in fast["techniques"].items()],
        "",
        "Time to target is training time only (evaluations and checkpoint writes excluded); wall time is the "
        "whole process (start-up, data, compile, evaluations). One run of each: on a shared machine repeat it "
        "before trusting a difference of a few per cent.",
        "",
        "The recipe's model after training (`samples.txt`, the first 300 characters):",
        "",
        "```",
        results[0]["samples"],
        "```",
        "",
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
