"""The language model's own tips on a CPU: what selective and budgeted checkpointing cost and save against none and
full checkpointing, what the chunked loss saves at GPT-2's vocabulary, and whether it trains the same; writes
docs/benchmarks/lm-tips-cpu-<date>.md.

    python scripts/bench_lm_tips.py                    # three interleaved sweeps of 4 minutes' measuring, ~25 min
    python scripts/bench_lm_tips.py --minutes 1        # shorter

Each sweep is ``python -m runner -m hydra/launcher=interleaved`` (runner/compare/: resident processes taking turns,
paired slices, the reference's copy as the A/A), so samples/s carry intervals; peak memory is each process's own
peak RSS from after its build (VmHWM reset through /proc/self/clear_refs: the same imported libraries in every
process, so differences are the activations'). The GPT is the Shakespeare recipe widened until its activations
show in the RSS (4 x 256, context 128, micro-batch 16: ~50 MiB of activations a block; the recipe's own 4 x 128,
context 64, micro-batch 12 holds ~1 MiB, inside the allocator's noise):
1. uncompiled: memory=none, selective, checkpointing;
2. compiled (memory=budget needs torch.compile's min-cut partitioner): none, budget, checkpointing;
3. GPT-2 124M's vocabulary (50,304) on a narrow GPT (2 x 256, context 64, micro-batch 4, synthetic tokens):
   task.loss=full against chunked (64 positions a chunk: four per micro-batch).
Then the loss curves: 50 steps of the recipe with task.loss=full and chunked (128 positions a chunk: six chunks of
the 768), one row per step (``metrics.jsonl``).
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
GPT = ["+experiment=shakespeare_char", "model.n_layer=4", "model.n_head=4", "model.n_embd=256", "data.block_size=128",
       "optimizer.base_batch_size=16", "trainer.max_steps=1000000", "trainer.eval_every=1000000",
       "trainer.eval_max_batches=1", "task.sample_tokens=0", "checkpoint.at_end=false"]
SWEEPS = {
    "memory, uncompiled": [*GPT, "memory=none,selective,checkpointing", "compile=off"],
    "memory, compiled": [*GPT, "memory=none,budget,checkpointing", "compile=default"],
    "loss at GPT-2's vocabulary": ["+experiment=gpt2_124m", "model.n_layer=2", "model.n_head=4", "model.n_embd=256",
                                   "data.block_size=64", "optimizer.base_batch_size=4", "compile=off",
                                   "precision=fp32", "dataloader=default", "data.synthetic_tokens=2000000",
                                   "trainer.max_steps=1000000", "trainer.eval_every=1000000",
                                   "trainer.eval_max_batches=1", "task.sample_tokens=0", "checkpoint.at_end=false",
                                   "task.loss_chunk_tokens=64", "task.loss=full,chunked"],
}


def runner(args: list[str], cwd: Path) -> None:
    env = {**os.environ, "WANDB_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "-m", "runner", *args, "logger=none", "trainer.doctor=false"], cwd=cwd,
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"failed: python -m runner {' '.join(args)}\n{proc.stderr[-3000:]}")


def sweep_section(title: str, args: list[str], folder: Path) -> list[str]:
    """Run one interleaved sweep into ``folder``; its jobs table, noise line and peak-memory differences."""
    cmd = ["-m", "hydra/launcher=interleaved", *args, f"hydra.sweep.dir={folder}"]
    load = os.getloadavg()[0]
    runner(cmd, REPO)
    report = (folder / "report.md").read_text().splitlines()
    start = report.index("## Jobs, fastest first")
    table = [line for line in report[start + 1:] if line.startswith("|")]
    noise = next(line for line in report if line.startswith("**Noise (A/A):**"))
    swept = next(a.split("=", 1)[0] for a in args if "," in a)
    peaks = {}
    for summary in sorted(folder.glob("*/summary.json")):  # the reference's copy (0-aa) after the reference (0)
        chosen = [o.split("=", 1)[1] for o in yaml.safe_load((summary.parent / ".hydra" / "overrides.yaml").read_text())
                  if o.startswith(f"{swept}=")]
        peaks.setdefault(chosen[0], json.loads(summary.read_text())["peak_memory_mb"])
    reference = peaks.get("none", peaks.get("full"))
    deltas = ", ".join(f"{k} {v - reference:+,.0f} MiB" for k, v in peaks.items() if v != reference or k in
                       ("none", "full"))
    return [f"## {title}", "", f"`python -m runner {' '.join(cmd[:-1])}` (load average {load:.2f} at the start)", "",
            *table, "", noise, "", f"Peak RSS against the reference ({reference:,.0f} MiB): {deltas}.", ""]


def loss_curves(work: Path) -> list[str]:
    """50 steps of the recipe with the full and the chunked loss: the largest per-step difference."""
    rows = {}
    for loss in ("full", "chunked"):
        folder = work / f"curve-{loss}"
        runner(["+experiment=shakespeare_char", "trainer.max_steps=50", "trainer.log_every=1",
                "trainer.eval_every=1000000", "trainer.eval_max_batches=1", "task.sample_tokens=0",
                f"task.loss={loss}", "task.loss_chunk_tokens=128", "trainer.progress=off",
                f"hydra.run.dir={folder}"], REPO)
        rows[loss] = [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()
                      if '"loss"' in line]
    worst = max(abs(a - b) for a, b in zip(rows["full"], rows["chunked"]))
    return ["## The chunked loss trains the same", "",
            f"50 steps of `+experiment=shakespeare_char`, `task.loss=full` and `task.loss=chunked "
            f"task.loss_chunk_tokens=128` (six chunks of each micro-batch's 768 positions), the training loss "
            f"of every step: the largest difference {worst:.2e} ({len(rows['full'])} steps; final losses "
            f"{rows['full'][-1]:.5f} and {rows['chunked'][-1]:.5f}).", ""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=4.0, help="measuring time of each sweep (interleave.max_minutes)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    sys.path.insert(0, str(REPO))
    import torch

    from runner.measure import hardware

    out = a.out or REPO / "docs" / "benchmarks" / f"lm-tips-cpu-{time.strftime('%Y-%m-%d')}.md"
    lines = [f"# The language model's tips on a CPU ({time.strftime('%Y-%m-%d')})", "",
             f"Machine: {os.cpu_count()} cores ({hardware.device_name(torch.device('cpu'))}, native bf16: "
             f"{hardware.cpu_has_native_bf16()}), torch {torch.__version__}; command: `python scripts/bench_lm_tips.py "
             f"{' '.join(sys.argv[1:])}`; each sweep measured {a.minutes:g} min, one process per configuration and "
             f"the reference's copy (A/A), the recipe's threads.", ""]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for i, (title, args) in enumerate(SWEEPS.items()):
            lines += sweep_section(title, [*args, f"interleave.max_minutes={a.minutes}", "interleave.processes=1"],
                                   work / f"sweep{i}")
        lines += loss_curves(work)
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())


if __name__ == "__main__":
    main()
