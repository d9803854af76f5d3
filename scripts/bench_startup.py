"""What a user waits before runner answers: ``--help``, a config error caught by ``validate``, one caught while Hydra
composes, and a whole tiny job, each in a fresh ``python -m runner`` process.

    python scripts/bench_startup.py [--baseline DIR] [--repeats 5] [--out docs/benchmarks/startup-cpu.md]

``--baseline DIR``: another checkout of runner (e.g. ``git worktree add DIR <commit>``), run through ``PYTHONPATH``
with the same interpreter, alternated with this one command by command, so both see the same machine. The page
gives the median and the range of the wall times (s), with the machine and its load average.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = [
    "data=synthetic",
    "data.shape=[3,16,16]",
    "data.train_size=256",
    "data.eval_size=64",
    "dataloader.batch_size=16",
    "trainer.max_steps=4",
    "trainer.warmup_steps=1",
    "trainer.log_every=2",
    "trainer.eval_max_batches=2",
    "trainer.progress=off",
    "trainer.device=cpu",
    "logger=none",
    "trainer.num_threads=1",
]
COMMANDS = {
    "`python -m runner --help` (every group's options and the composed config)": ["--help"],
    "`python -m runner dataloader.batch_size=0` (refused by validate)": ["dataloader.batch_size=0"],
    "`python -m runner optimizer.lr=abc` (refused while composing)": ["optimizer.lr=abc"],
    "a tiny job (`tests/conftest.py` TINY: 4 steps, summary, checkpoint)": TINY,
}


def wall_s(checkout: Path, args: list[str], cwd: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(checkout), "WANDB_MODE": "offline"}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "runner", *args], cwd=cwd, env=env, capture_output=True)
    return time.perf_counter() - start


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="another checkout of runner, alternated with this one")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks" / "startup-cpu.md")
    args = parser.parse_args()
    checkouts = {"this checkout": REPO} | ({f"baseline ({args.baseline.name})": args.baseline} if args.baseline else {})
    times = {(c, k): [] for c in checkouts for k in COMMANDS}
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as cwd:
        for _ in range(args.repeats):
            for key, command in COMMANDS.items():
                for name, checkout in checkouts.items():  # alternated: both see the same moment of the machine
                    times[(name, key)].append(wall_s(checkout, command, Path(cwd)))
    load_end = os.getloadavg()[0]
    lines = [
        "# Start-up: what `python -m runner` costs before it answers\n",
        f"`python scripts/bench_startup.py{f' --baseline {args.baseline}' if args.baseline else ''} "
        f"--repeats {args.repeats}`, {time.strftime('%Y-%m-%d')}, {cpu_name()}, "
        f"{os.cpu_count()} cores, load average {load_start:.2f} at the start and {load_end:.2f} at the end. "
        f"Wall seconds of a fresh process, median [min-max] of {args.repeats}, the checkouts alternated.\n",
        "| command | " + " | ".join(checkouts) + " |",
        "|---|" + "---|" * len(checkouts),
    ]
    for key in COMMANDS:
        cells = [
            f"{statistics.median(t):.2f} [{min(t):.2f}-{max(t):.2f}]" for t in (times[(c, key)] for c in checkouts)
        ]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
