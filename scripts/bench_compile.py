"""Regional against whole-model torch.compile on the Shakespeare GPT: how long the first steps take (the compile) and
the steady step time, each run a fresh ``python -m runner`` process with an empty inductor cache, the two alternated.

``compile.regional=true`` compiles each transformer block (runner/techniques/prepare.py ``apply_compile``; torchtitan's
default); the whole-model compile traces embeddings, blocks and head as one graph. Each run trains
``+experiment=shakespeare_char`` (4 x 128 GPT, windows of 64, batch 12) for ``--steps`` steps with the loss read
every step (``trainer.log_every=1``, no warm-up left out), so metrics.jsonl holds every step's time:

- compile (s): the training time beyond ``steps`` x the steady step -- what the first steps cost over a steady one,
  where dynamo traces and inductor compiles the forward's and the backward's graphs (``train_time_s`` of
  summary.json, which leaves evaluation out);
- steady step (ms): the median step from step 21 on;
- process (s): the whole process, start to exit (imports, data, the final evaluation's eval-mode compile included);
- process CPU (s): its user + system CPU time, its compile workers included (``getrusage`` of the children): on a
  shared machine the work done, which other processes' load does not stretch as it stretches wall time.

Each figure is the median of ``--repeats`` runs per mode; runs alternate whole, regional, whole, ... so drift on a
shared machine hits both alike.

    python scripts/bench_compile.py                     # writes docs/benchmarks/compile-regional-cpu.md
    python scripts/bench_compile.py --repeats 1 --steps 40 --out /tmp/compile.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from runner import REPO_ROOT
from runner.measure import hardware

TEXT = REPO_ROOT / "data" / "tinyshakespeare" / "input.txt"  # embedded
MODES = {"whole": "compile.regional=false", "regional": "compile.regional=true"}


def overrides(steps: int, text: Path) -> list[str]:
    return [
        "+experiment=shakespeare_char",
        f"data.path={text}",
        "compile=default",
        f"trainer.max_steps={steps}",
        f"trainer.eval_every={steps}",
        "trainer.eval_max_batches=1",
        "trainer.log_every=1",
        "trainer.warmup_steps=0",
        "task.sample_tokens=0",
        "trainer.device=cpu",
        "trainer.progress=off",
        "trainer.doctor=false",
        "logger=none",
    ]


def run_once(mode: str, steps: int, text: Path, work: Path) -> dict:
    """One fresh process; its compile time (s), steady median step (ms) and process wall time (s)."""
    job = work / f"{mode}-{time.time_ns()}"
    env = os.environ | {
        "TORCHINDUCTOR_CACHE_DIR": str(job / "inductor"),
        "WANDB_MODE": "disabled",
        "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO_ROOT), os.environ.get("PYTHONPATH")))),
    }
    t0, cpu0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(
        [sys.executable, "-m", "runner", *overrides(steps, text), MODES[mode], f"hydra.run.dir={job}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    wall = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = cpu1.ru_utime - cpu0.ru_utime + cpu1.ru_stime - cpu0.ru_stime
    if proc.returncode:
        raise SystemExit(f"error: the {mode} run failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    times = {r["step"]: r["step_time_ms"] for r in rows if r.get("step_time_ms") is not None and "loss" in r}
    summary = json.loads((job / "summary.json").read_text())
    assert summary["techniques"].get("compile_regional", "off") == ("applied" if mode == "regional" else "off")
    steady = statistics.median(t for s, t in times.items() if s > 20)
    return {
        "compile_s": summary["train_time_s"] - summary["steps"] * steady / 1e3,
        "steady_ms": steady,
        "process_s": wall,
        "cpu_s": cpu,
        "load": hardware.load_average(),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--text", type=Path, default=TEXT)
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "docs" / "benchmarks" / "compile-regional-cpu.md")
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for mode in MODES:
                r = run_once(mode, args.steps, args.text, Path(tmp))
                runs[mode].append(r)
                print(
                    f"{mode} {i + 1}/{args.repeats}: compile {r['compile_s']:.1f} s, steady "
                    f"{r['steady_ms']:.1f} ms, process {r['process_s']:.1f} s ({r['cpu_s']:.1f} CPU s), "
                    f"load {r['load']}",
                    flush=True,
                )

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[mode])

    m = hardware.describe_machine()
    command = f"python scripts/bench_compile.py --steps {args.steps} --repeats {args.repeats}"
    job = " ".join(overrides(args.steps, Path("<input.txt>")))
    lines = [
        "# Regional against whole-model torch.compile: the Shakespeare GPT on a CPU",
        "",
        f"`{command}` ({datetime.date.today().isoformat()}; {m['cpu']}, {m['cpu_cores']} cores, shared; torch "
        f"{m['torch']}, Python {m['python']}). Each run: a fresh `python -m runner {job} compile.regional=false|true` "
        f"process with an empty inductor cache; the modes alternate. Compile: the training time beyond {args.steps} x "
        f"the steady step (what the first steps cost, where the forward and backward graphs are compiled; evaluation "
        f"left out); steady: the median step from step 21 on; process: start to exit (the final evaluation's eval-mode "
        f"compile included); process CPU: its user + system time, compile workers included. Figures: medians of "
        f"{args.repeats} runs.",
        "",
        "| mode | compile (s) | steady step (ms) | process (s) | process CPU (s) |",
        "|---|---:|---:|---:|---:|",
    ]
    for mode in MODES:
        lines.append(
            f"| {mode} (compile.regional={'true' if mode == 'regional' else 'false'}) | "
            f"{med(mode, 'compile_s'):.1f} | {med(mode, 'steady_ms'):.1f} | {med(mode, 'process_s'):.1f} | "
            f"{med(mode, 'cpu_s'):.1f} |"
        )
    lines += [
        "",
        f"Regional ÷ whole: compile ×{med('regional', 'compile_s') / med('whole', 'compile_s'):.2f}, steady "
        f"step ×{med('regional', 'steady_ms') / med('whole', 'steady_ms'):.2f}, process "
        f"×{med('regional', 'process_s') / med('whole', 'process_s'):.2f}, process CPU "
        f"×{med('regional', 'cpu_s') / med('whole', 'cpu_s'):.2f}.",
        "",
        "Every run (in the order they ran):",
        "",
        "| run | mode | compile (s) | steady step (ms) | process (s) | process CPU (s) | load average (1 min, after) |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for i in range(args.repeats):
        for mode in MODES:
            r = runs[mode][i]
            lines.append(
                f"| {i + 1} | {mode} | {r['compile_s']:.1f} | {r['steady_ms']:.1f} | {r['process_s']:.1f} | "
                f"{r['cpu_s']:.1f} | {r['load']} |"
            )
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
