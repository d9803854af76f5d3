"""The language model's own tips on a CPU: what selective and budgeted checkpointing cost and save against none and
full checkpointing, what the chunked loss saves at GPT-2's vocabulary, and whether it trains the same; writes
docs/benchmarks/lm-tips-cpu-<date>.md.

    python scripts/bench_lm_tips.py                    # four interleaved sweeps of 4 minutes' measuring, ~30 min
    python scripts/bench_lm_tips.py --minutes 1        # shorter

Each sweep is ``python -m runner -m hydra/launcher=interleaved`` (runner/compare/: resident processes taking turns,
paired slices, the reference's copy as the A/A), so samples/s carry intervals; peak memory is each process's own
peak RSS from after its build (VmHWM reset through /proc/self/clear_refs: the same imported libraries in every
process, so differences are the activations'). The GPT is the Shakespeare recipe widened until its activations
show in the RSS (4 x 256, context 128, micro-batch 16: ~50 MiB of activations a block; the recipe's own 4 x 128,
context 64, micro-batch 12 holds ~1 MiB, inside the allocator's noise):
1. uncompiled: memory=none, selective, checkpointing;
2. compiled (memory=budget needs torch.compile's min-cut partitioner): none, budget, checkpointing;
3. GPT-2 124M's vocabulary (50,304) on a narrow GPT (2 x 128, context 256, micro-batch 8, no accumulation,
   synthetic tokens): task.loss=full against chunked (256 positions a chunk: eight per micro-batch). As in GPT-2 124M
   (12 x 1024 positions, width 768) a micro-batch has 16x as many positions as the model is wide: the logits
   (positions x vocabulary) then outweigh the head's weight gradient (vocabulary x width), which the chunked loss
   holds in fp32 from its forward to its backward.
4. the optimizer step compiled (AdamW, its LR a tensor) against eager, the model uncompiled: compile.optimizer.
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
GPT = [
    "+experiment=shakespeare_char",
    "model.n_layer=4",
    "model.n_head=4",
    "model.n_embd=256",
    "data.block_size=128",
    "optimizer.base_batch_size=16",
    "trainer.max_steps=1000000",
    "trainer.eval_every=1000000",
    "trainer.eval_max_batches=1",
    "task.sample_tokens=0",
    "checkpoint.at_end=false",
]
SWEEPS = {
    "memory, uncompiled": [*GPT, "memory=none,selective,checkpointing", "compile=off"],
    "memory, compiled": [*GPT, "memory=none,budget,checkpointing", "compile=default"],
    # the logits (N positions x V) outweigh the head's weight gradient (V x C, which the chunked loss holds in fp32)
    # only where N >> C: GPT-2 124M's micro-batch has N = 12 x 1024 = 16 C; here N = 8 x 256 = 16 C as well
    "loss at GPT-2's vocabulary": [
        "+experiment=gpt2_124m",
        "model.n_layer=2",
        "model.n_head=2",
        "model.n_embd=128",
        "data.block_size=256",
        "optimizer.base_batch_size=8",
        "memory.accumulate_steps=1",
        "compile=off",
        "precision=fp32",
        "dataloader=default",
        "data.synthetic_tokens=2000000",
        "trainer.max_steps=1000000",
        "trainer.eval_every=1000000",
        "trainer.eval_max_batches=1",
        "task.sample_tokens=0",
        "checkpoint.at_end=false",
        "task.loss_chunk_tokens=256",
        "task.loss=full,chunked",
    ],
    "the compiled optimizer step": [*GPT, "compile=off", "compile.optimizer=false,true"],
}


def runner(args: list[str], cwd: Path) -> None:
    env = {**os.environ, "WANDB_MODE": "disabled"}
    proc = subprocess.run(
        [sys.executable, "-m", "runner", *args, "logger=none", "trainer.doctor=false"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        sys.exit(f"failed: python -m runner {' '.join(args)}\n{proc.stderr[-3000:]}")


def sweep_section(title: str, args: list[str], folder: Path) -> list[str]:
    """Run one interleaved sweep into ``folder``; its jobs table, noise line and peak-memory differences."""
    cmd = ["-m", "hydra/launcher=interleaved", *args, f"hydra.sweep.dir={folder}"]
    load = os.getloadavg()[0]
    runner(cmd, REPO)
    report = (folder / "report.md").read_text().splitlines()
    start = report.index("## Jobs, fastest first")
    table = [line for line in report[start + 1 :] if line.startswith("|")]
    noise = next(line for line in report if line.startswith("**Noise (A/A):**"))
    swept = next(a.split("=", 1)[0] for a in args if "," in a)
    peaks = {}
    for summary in sorted(folder.glob("*/summary.json")):  # the reference's copy (0-aa) after the reference (0)
        chosen = [
            o.split("=", 1)[1]
            for o in yaml.safe_load((summary.parent / ".hydra" / "overrides.yaml").read_text())
            if o.startswith(f"{swept}=")
        ]
        peaks.setdefault(chosen[0].lower(), json.loads(summary.read_text())["peak_memory_mb"])  # Hydra: False
    reference = peaks.get("none", peaks.get("full", peaks.get("false")))
    deltas = ", ".join(
        f"{k} {v - reference:+,.0f} MiB" for k, v in peaks.items() if v != reference or k in ("none", "full", "false")
    )
    return [
        f"## {title}",
        "",
        f"`python -m runner {' '.join(cmd[:-1])}` (load average {load:.2f} at the start)",
        "",
        *table,
        "",
        noise,
        "",
        f"Peak RSS against the reference ({reference:,.0f} MiB): {deltas}.",
        "",
    ]


def loss_curves(work: Path) -> list[str]:
    """50 steps of the recipe with the full and the chunked loss: the largest per-step difference."""
    rows = {}
    for loss in ("full", "chunked"):
        folder = work / f"curve-{loss}"
        runner(
            [
                "+experiment=shakespeare_char",
                "trainer.max_steps=50",
                "trainer.log_every=1",
                "trainer.eval_every=1000000",
                "trainer.eval_max_batches=1",
                "task.sample_tokens=0",
                f"task.loss={loss}",
                "task.loss_chunk_tokens=128",
                "scheduler.warmup_steps=10",
                "trainer.progress=off",
                f"hydra.run.dir={folder}",
            ],
            REPO,
        )
        rows[loss] = [
            json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines() if '"loss"' in line
        ]
    worst = max(abs(a - b) for a, b in zip(rows["full"], rows["chunked"]))
    return [
        "## The chunked loss trains the same",
        "",
        f"50 steps of `+experiment=shakespeare_char`, `task.loss=full` and `task.loss=chunked "
        f"task.loss_chunk_tokens=128` (six chunks of each micro-batch's 768 positions), the training loss "
        f"of every step: the largest difference {worst:.2e} ({len(rows['full'])} steps; final losses "
        f"{rows['full'][-1]:.5f} and {rows['chunked'][-1]:.5f}).",
        "",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=4.0, help="measuring time of each sweep (interleave.max_minutes)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--only", type=int, choices=range(len(SWEEPS)), help="run this sweep alone (0-based), no curves")
    a = ap.parse_args()
    sys.path.insert(0, str(REPO))
    import torch

    from runner.measure import hardware

    out = a.out or REPO / "docs" / "benchmarks" / f"lm-tips-cpu-{time.strftime('%Y-%m-%d')}.md"
    lines = [
        f"# The language model's tips on a CPU ({time.strftime('%Y-%m-%d')})",
        "",
        f"Machine: {os.cpu_count()} cores ({hardware.device_name(torch.device('cpu'))}, native bf16: "
        f"{hardware.cpu_has_native_bf16()}), torch {torch.__version__}; command: `python scripts/bench_lm_tips.py "
        f"{' '.join(sys.argv[1:])}`; each sweep measured {a.minutes:g} min, one process per configuration and "
        f"the reference's copy (A/A), the recipe's threads.",
        "",
    ]
    work = Path(tempfile.mkdtemp(prefix="bench_lm_tips-"))  # kept: each sweep's report.md and jobs
    if a.only is None:
        lines += loss_curves(work)  # the cheap check first: a failure shows in a minute, not after the sweeps
        out.write_text("\n".join(lines) + "\n")
    for i, (title, args) in enumerate(SWEEPS.items()):
        if a.only is not None and i != a.only:
            continue
        lines += sweep_section(
            title, [*args, f"interleave.max_minutes={a.minutes}", "interleave.processes=1"], work / f"sweep{i}"
        )
        out.write_text("\n".join(lines) + "\n")  # each section as it is measured: a later failure keeps them
    print(out.read_text())
    print(f"the sweeps' folders: {work}")


if __name__ == "__main__":
    main()
