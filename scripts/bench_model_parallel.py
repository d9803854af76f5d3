#!/usr/bin/env python
"""What model parallelism costs on this machine: the Shakespeare GPT in one process and on 2 processes as DDP,
tensor parallel (``distributed=tp``) and a 2-stage pipeline (``distributed=pp``, 1F1B); writes
docs/benchmarks/model-parallel-<device>-<date>.md.

    python scripts/bench_model_parallel.py [--repeats 3] [--steps 60] [overrides...]

Every run is a real ``python -m runner`` / ``torchrun --nproc-per-node=2 -m runner`` job of
``+experiment=shakespeare_char`` (4 blocks of width 128, batch 12 of 64 characters per model copy), one OpenMP
thread per process. DDP trains two model copies (global batch 24), tp and pp one model on two ranks (global batch
12): samples/s is each job's own global figure (warm-up excluded, the slowest rank's time), peak memory the
largest rank's. The layouts are repeated ``--repeats`` times, interleaved, so load from elsewhere hits all alike;
the table gives medians and the min-max spread.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LAYOUTS = {
    "one process": (1, []),
    "ddp x2": (2, ["distributed=ddp"]),
    "tp x2": (2, ["distributed=tp"]),
    "pp x2 (1F1B)": (2, ["distributed=pp"]),
}


def run(procs: int, extra: list[str], job_dir: Path, steps: int) -> dict:
    """One job; returns its summary. Raises RuntimeError with the job's output when it fails."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "TMPDIR": str(job_dir.parent)}
    args = [
        "+experiment=shakespeare_char",
        f"trainer.max_steps={steps}",
        "scheduler.warmup_steps=5",
        "trainer.num_threads=1",
        "trainer.eval_every=100000",
        "trainer.eval_max_batches=1",
        "logger=none",
        "task.sample_tokens=0",
        "checkpoint.at_end=false",
        "trainer.progress=off",
        *extra,
        f"hydra.run.dir={job_dir}",
    ]
    launcher = (
        [sys.executable, "-m", "runner"]
        if procs == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={procs}",
            "-m",
            "runner",
        ]
    )
    proc = subprocess.run([*launcher, *args], cwd=job_dir.parent, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(launcher + args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads((job_dir / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per run (warm-up included)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides added to every run")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    figures: dict[str, list[tuple[float, float]]] = {name: [] for name in LAYOUTS}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for name, (procs, extra) in LAYOUTS.items():
                s = run(
                    procs,
                    [*extra, *args.overrides],
                    Path(tmp) / f"{repeat}-{procs}-{len(figures[name])}-{name.split()[0]}",
                    args.steps,
                )
                figures[name].append((s["samples_per_sec"], s["peak_memory_mb"]))
                print(f"{name}: {s['samples_per_sec']:.1f} samples/s, peak {s['peak_memory_mb']:.0f} MB", flush=True)
    base = statistics.median(sps for sps, _ in figures["one process"])
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    rows = []
    for name, values in figures.items():
        sps = sorted(v for v, _ in values)
        rows.append(
            f"| {name} | {statistics.median(sps):.1f} [{sps[0]:.1f}–{sps[-1]:.1f}] | "
            f"×{statistics.median(sps) / base:.2f} | {statistics.median(m for _, m in values):.0f} |"
        )
    day = time.strftime("%Y-%m-%d")
    command = "python scripts/bench_model_parallel.py " + " ".join(
        [f"--repeats {args.repeats}", f"--steps {args.steps}", *args.overrides]
    )
    page = [
        f"# Model parallelism on {os.cpu_count()} CPU cores ({day})",
        "",
        f"Machine: {cpu}, {os.cpu_count()} cores, load {load:.2f} before the runs; one OpenMP thread per "
        f"process. Command: `{command}`. Job: `+experiment=shakespeare_char` (GPT, 4 blocks x 128, batch 12 x 64 "
        f"characters per model copy), {args.steps} steps; {args.repeats} repeats of each layout, interleaved.",
        "",
        "| layout | samples/s, median [min–max] | vs one process | peak memory MB (largest rank) |",
        "|---|---:|---:|---:|",
        *rows,
        "",
        "DDP trains two model copies (global batch 24); tp and pp split one model over the two ranks (global "
        'batch 12), so their samples/s is one model\'s. Reading: docs/scaling.md, "Model parallelism".',
    ]
    out = REPO / "docs" / "benchmarks" / f"model-parallel-cpu-{day}.md"
    out.write_text("\n".join(page) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
