#!/usr/bin/env python
"""Samples/s of one job on 1 and 2 processes (DDP) on this machine: the figures of docs/benchmarks/scaling.md.

    python scripts/bench_scaling.py [--repeats 3] [--steps 60] [--batch-size 64] [--out bench-scaling.json]
        [overrides...]

Layouts (processes x OpenMP threads each): 1x1, 1xC and Px1 for P = 2 (C = the cores of this machine), so the
2-process figure is compared both with one process on one core (scaling efficiency, weak scaling: each rank
keeps its batch size, the global batch doubles) and with one process using the same cores through threads.
Every run is a real ``python -m runner`` / ``torchrun -m runner distributed=ddp`` job; samples/s is the
job's own global figure from ``summary.json`` (warm-up steps excluded, slowest rank's time). Each layout is
repeated ``--repeats`` times, interleaved (1x1, 1xC, 2x1, 1x1, ...) so a burst of load from other users of
the machine hits all layouts alike; the table gives the median and the min-max spread.

Default job: mnist_cnn on the embedded MNIST, fp32, ``--batch-size`` samples per rank per step. Extra
arguments are Hydra overrides added to every run (e.g. ``model=resnet18 data=cifar10``).
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

import torch

from runner.measure.hardware import device_name

REPO = Path(__file__).resolve().parent.parent


def run(procs: int, threads: int, overrides: list[str], job_dir: Path, timeout: float) -> dict:
    """One job; returns its summary. Raises RuntimeError with the job's output when it fails."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "WANDB_MODE": "disabled",
        "HYDRA_FULL_ERROR": "1",
        "TMPDIR": str(job_dir.parent),
    }  # torchrun's own temp folders go away with ours
    args = [*overrides, f"hydra.run.dir={job_dir}"]
    if procs == 1:
        cmd = [sys.executable, "-m", "runner", *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={procs}",
            "-m",
            "runner",
            "distributed=ddp",
            *args,
        ]
    proc = subprocess.run(cmd, cwd=job_dir.parent, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads((job_dir / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per run (warm-up included)")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the figures")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--procs", type=int, default=2, help="processes of the data-parallel layout")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
    parser.add_argument("--out", type=Path, default=None, help="also write every run's figures here (JSON)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides added to every run")
    a = parser.parse_args()

    cores = os.cpu_count() or 1
    job = [
        "trainer.device=cpu",
        "logger=none",
        "trainer.progress=off",
        f"trainer.max_steps={a.steps}",
        f"trainer.warmup_steps={a.warmup}",
        f"trainer.log_every={a.steps}",
        "trainer.eval_every=1000000",
        "trainer.eval_max_batches=1",
        f"dataloader.batch_size={a.batch_size}",
        *a.overrides,
    ]
    layouts = [(1, 1), (1, cores), (a.procs, max(1, cores // a.procs))]
    layouts = list(dict.fromkeys(layouts))  # 1 core: 1x1 only once
    results: dict[str, list[float]] = {f"{p}x{t}": [] for p, t in layouts}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-scaling-") as tmp:
        for r in range(a.repeats):
            for p, t in layouts:
                started = time.perf_counter()
                s = run(p, t, job, Path(tmp) / f"{p}x{t}-{r}", a.timeout)
                results[f"{p}x{t}"].append(s["samples_per_sec"])
                print(
                    f"repeat {r + 1}/{a.repeats}  {p} process(es) x {t} thread(s): {s['samples_per_sec']:8.1f} "
                    f"samples/s  (global batch {s['global_batch_size']}, world_size {s['world_size']}, "
                    f"{time.perf_counter() - started:.0f} s)",
                    flush=True,
                )
    load_after = os.getloadavg()

    med = {k: statistics.median(v) for k, v in results.items()}
    base = med["1x1"]
    cpu = device_name(torch.device("cpu"))
    print(f"\nmachine: {cpu}, {cores} cores, torch {torch.__version__}, Python {platform.python_version()}")
    print(f"load average (1 min) before/after: {load_before[0]:.2f} / {load_after[0]:.2f}")
    print(f"job: {' '.join(job)}; {a.repeats} repeats each\n")
    print("| processes x threads | samples/s (median) | min - max | vs 1x1 | scaling efficiency |")
    print("|---|---:|---:|---:|---:|")
    for (p, t), (k, v) in zip(layouts, results.items()):
        eff = med[k] / (base * p) if p > 1 else None
        print(
            f"| {p} x {t} | {med[k]:.0f} | {min(v):.0f} - {max(v):.0f} | {med[k] / base:.2f}x | "
            f"{'-' if eff is None else f'{eff:.2f}'} |"
        )
    if a.out:
        a.out.write_text(
            json.dumps(
                {
                    "machine": cpu,
                    "cores": cores,
                    "torch": torch.__version__,
                    "load_before": load_before,
                    "load_after": load_after,
                    "job": job,
                    "samples_per_sec": results,
                },
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
