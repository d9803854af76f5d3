"""What a checkpoint costs: the time the training loop is blocked per checkpoint, synchronous and
asynchronous (``checkpoint.async=true``), as a multiple of the median step time, for resnet18 (CIFAR-sized
inputs) and the GPT of ``+experiment=shakespeare_char``; writes docs/benchmarks/checkpointing-cost.md
(docs/checkpointing.md, written by hand, quotes it).

    python scripts/bench_checkpoint.py
    python scripts/bench_checkpoint.py --steps 40 --every 10 --out /tmp/ck.md

Each configuration is one ``python -m runner`` process that checkpoints every ``--every`` steps and once at
the end; ``summary.json`` gives ``checkpoint_time_s`` (blocked time, summed; excluded from every speed
figure) and ``step_time_ms_median``. The size on disk is that of the last checkpoint folder. Repeated
``--repeats`` times in alternating order; the table gives medians and the min–max.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

JOBS = {
    "resnet18 (CIFAR stem, 32×32, batch 64)": [
        "model=resnet18",
        "model.cifar_stem=true",
        "data=synthetic",
        "data.shape=[3,32,32]",
        "data.train_size=4096",
        "data.eval_size=64",
        "dataloader.batch_size=64",
    ],
    "GPT (4 layers × 128, block 64, batch 12)": ["+experiment=shakespeare_char", "scheduler.warmup_steps=2"],
}


def run(job: list[str], async_save: bool, steps: int, every: int, folder: Path) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "runner",
        *job,
        "logger=none",
        "trainer.progress=off",
        f"trainer.max_steps={steps}",
        "trainer.warmup_steps=3",
        f"trainer.log_every={every}",
        "trainer.eval_every=100000",
        "trainer.eval_max_batches=1",
        f"checkpoint.every_steps={every}",
        f"checkpoint.async={str(async_save).lower()}",
        "checkpoint.keep_last=1",
        f"hydra.run.dir={folder}",
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    s = json.loads((folder / "summary.json").read_text())
    saves = steps // every + (0 if steps % every == 0 else 1)  # the end-of-run save replaces the last scheduled one
    (last,) = sorted((folder / "checkpoints").glob("step_*"))
    size = sum(f.stat().st_size for f in last.iterdir())
    return {"per_save_s": s["checkpoint_time_s"] / saves, "step_ms": s["step_time_ms_median"], "size_mb": size / 2**20}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks" / "checkpointing-cost.md")
    args = p.parse_args()
    scratch = REPO / "outputs" / "bench_checkpoint" / time.strftime("%Y-%m-%d_%H-%M-%S")
    results: dict[tuple[str, bool], list[dict]] = {}
    load = [os.getloadavg()[0]]
    for r in range(args.repeats):
        order = [(name, a) for name in JOBS for a in (False, True)]
        for name, a in order if r % 2 == 0 else order[::-1]:
            folder = scratch / f"{len(results.get((name, a), []))}-{abs(hash((name, a)))}-{r}"
            results.setdefault((name, a), []).append(run(JOBS[name], a, args.steps, args.every, folder))
            print(name, "async" if a else "sync", results[(name, a)][-1], flush=True)
    load.append(os.getloadavg()[0])
    import torch

    from runner.measure.hardware import device_name

    lines = [
        "| model | checkpoint | blocked per checkpoint (ms, median; min–max) | median step (ms) | "
        "blocked ÷ step | size on disk (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for (name, a), runs in results.items():
        per = [x["per_save_s"] * 1e3 for x in runs]
        step = statistics.median(x["step_ms"] for x in runs)
        lines.append(
            f"| {name} | {'async' if a else 'sync'} | {statistics.median(per):.0f} "
            f"({min(per):.0f}–{max(per):.0f}) "
            f"| {step:.0f} | {statistics.median(per) / step:.2f} | {runs[0]['size_mb']:.1f} |"
        )
    header = [
        f"Machine: {device_name(torch.device('cpu'))}, {os.cpu_count()} cores; torch {torch.__version__}; "
        f"load average {load[0]:.1f} before, {load[1]:.1f} after.",
        "",
        f"Command: `python scripts/bench_checkpoint.py {' '.join(sys.argv[1:])}`".rstrip(),
        "",
        f"{args.repeats} repeats in alternating order; each run {args.steps} steps, a checkpoint every {args.every} "
        "steps (model, optimizer, schedule, scaler, TrainState, RNG), written to the local disk.",
        "",
    ]
    args.out.write_text("\n".join(header + lines) + "\n")
    print("\n".join(header + lines))


if __name__ == "__main__":
    main()
