"""runner's Shakespeare GPT beside nanoGPT's own ``train.py`` on this machine: whole wall time and validation loss.

    python scripts/bench_nanogpt.py --nanogpt ~/nanoGPT                      # recipe vs nanoGPT, 2 repeats each
    python scripts/bench_nanogpt.py --nanogpt ~/nanoGPT --tuned outputs/tune/speed/<date>_<time> --repeats 3

``--nanogpt``: a checkout of https://github.com/karpathy/nanoGPT whose character-level data is prepared
(``python data/shakespeare_char/prepare.py`` there; copy Tiny Shakespeare to ``data/shakespeare_char/input.txt``
first where there is no network). nanoGPT runs its README's CPU command, which is runner's
``+experiment=shakespeare_char`` (docs/benchmarks/gpt-cpu.md checked every setting); runner runs the recipe with
evaluation at nanoGPT's cost (``trainer.eval_max_batches=20``, as its ``--eval_iters=20``), and with ``--tuned DIR``
also the speed tuner's pick (``'+experiment=[shakespeare_char,tuned]' --config-dir DIR``).

The runs alternate (each repeat in a new random order), so drift on this shared machine falls on every
program alike; the table gives each program's median and range over the repeats. Wall time is the whole
process, start-up included, as a user waits for it. Validation loss is each program's 20-batch estimate at
step 2000 (nanoGPT: 20 random batches; runner: the first 20 windows of the split): its sampling error is
about 0.015 (docs/benchmarks/gpt-cpu.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: nanoGPT's README, "I only have a macbook" (CPU), with the shakespeare_char config.
NANOGPT = ["train.py", "config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20",
           "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128",
           "--max_iters=2000", "--lr_decay_iters=2000", "--dropout=0.0"]
RUNNER = ["logger=none", "trainer.eval_max_batches=20", "task.sample_tokens=0", "trainer.doctor=false"]


def timed(cmd: list[str], cwd: Path) -> tuple[float, str]:
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return wall, proc.stdout


def run_nanogpt(root: Path, scratch: Path) -> dict:
    out = scratch / f"nanogpt-{time.time_ns()}"
    wall, stdout = timed([sys.executable, *NANOGPT, f"--out_dir={out}"], root)
    losses = re.findall(r"step (\d+): train loss [\d.]+, val loss ([\d.]+)", stdout)
    return {"wall_s": wall, "val_loss": float(losses[-1][1]) if losses else None}


def run_runner(experiment: str, config_dir: Path | None, scratch: Path) -> dict:
    folder = scratch / f"runner-{time.time_ns()}"
    search = ["--config-dir", str(config_dir.resolve())] if config_dir else []
    wall, _ = timed([sys.executable, "-m", "runner", *search, f"+experiment={experiment}", *RUNNER,
                     f"hydra.run.dir={folder}"], REPO)
    summary = json.loads((folder / "summary.json").read_text())
    return {"wall_s": wall, "val_loss": summary.get("eval_loss"), "tokens_per_sec": summary.get("tokens_per_sec")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nanogpt", type=Path, required=True, help="a nanoGPT checkout with shakespeare_char prepared")
    p.add_argument("--tuned", type=Path, help="a runner.tune speed folder (holds experiment/tuned.yaml)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks" / "nanogpt-cpu.md")
    args = p.parse_args()
    if not (args.nanogpt / "data" / "shakespeare_char" / "train.bin").is_file():
        sys.exit(f"error: {args.nanogpt}/data/shakespeare_char/train.bin is missing: run "
                 f"`python data/shakespeare_char/prepare.py` in {args.nanogpt} first")
    programs = {"nanoGPT train.py": lambda s: run_nanogpt(args.nanogpt, s),
                "runner recipe": lambda s: run_runner("shakespeare_char", None, s)}
    if args.tuned:
        programs["runner recipe + tuned"] = lambda s: run_runner("[shakespeare_char,tuned]", args.tuned, s)
    results: dict[str, list[dict]] = {name: [] for name in programs}
    started = time.strftime("%Y-%m-%d %H:%M")
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="bench-nanogpt-") as scratch:
        for r in range(args.repeats):
            order = list(programs)
            rng.shuffle(order)
            for name in order:
                load = os.getloadavg()[0]
                figures = programs[name](Path(scratch)) | {"load_before": load}
                results[name].append(figures)
                print(f"repeat {r + 1} {name}: {figures}", flush=True)
    write(args, results, started)


def write(args, results: dict[str, list[dict]], started: str) -> None:
    sys.path.insert(0, str(REPO))
    from runner import hardware

    machine = hardware.describe_machine()
    cpu = machine.get("cpu") or platform.processor()
    loads = "; ".join(f"{name} " + ", ".join(f"{x['load_before']:.1f}" for x in runs) for name, runs in results.items())
    command = "python scripts/bench_nanogpt.py --nanogpt <nanoGPT>" + (" --tuned <tuned>" if args.tuned else "") \
        + f" --repeats {args.repeats}"
    lines = ["# runner's Shakespeare GPT beside nanoGPT's own train.py (CPU)", "",
             f"Machine: {cpu} ({machine.get('cpu_cores')} cores); torch {machine.get('torch')}; "
             f"Python {platform.python_version()}; "
             f"ran {started}.", "", f"Command: `{command}` (the module docstring says what each program runs).", "",
             "| program | wall time, median (s) | range (s) | validation loss at step 2000 (20 batches) | tokens/s (runner) |",
             "|---|---|---|---|---|"]
    base = statistics.median(x["wall_s"] for x in results["nanoGPT train.py"])
    for name, runs in results.items():
        walls = [x["wall_s"] for x in runs]
        losses = ", ".join(f"{x['val_loss']:.4f}" for x in runs if x["val_loss"] is not None)
        tps = ", ".join(f"{x['tokens_per_sec']:,.0f}" for x in runs if x.get("tokens_per_sec"))
        lines.append(f"| {name} | {statistics.median(walls):.1f} (×{statistics.median(walls) / base:.2f}) | "
                     f"{min(walls):.1f}–{max(walls):.1f} | {losses} | {tps or '-'} |")
    lines += ["", f"Load average (1 min) before each run: {loads}.", ""]
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
