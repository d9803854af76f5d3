"""What the compile cache in the job folder saves: a compiled job run cold (an empty Inductor cache), then from a copy
of the folder's ``compile_cache/`` on "another node" (another empty Inductor cache), then with the machine's warm
Inductor cache; writes docs/benchmarks/compile-cache-<device>-<date>.md.

    python scripts/bench_compile_cache.py                      # the MNIST CNN, compile=default, 3 repeats
    python scripts/bench_compile_cache.py --job +experiment=shakespeare_char --repeats 2

Each run is a fresh ``python -m runner`` process; the figures are its ``summary.json`` ``one_time``: torch.compile's
own seconds (``compile_s``), the warm-up's excess over steady steps and the whole process's wall time. The three
kinds alternate within each repeat; the load average is recorded before each run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def job(folder: Path, inductor: Path, overrides: list[str]) -> tuple[dict, float, float]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor), "WANDB_MODE": "disabled"}
    cmd = [
        sys.executable,
        "-m",
        "runner",
        *overrides,
        "compile=default",
        "logger=none",
        "trainer.progress=off",
        "trainer.doctor=false",
        f"hydra.run.dir={folder}",
    ]
    load, started = os.getloadavg()[0], time.perf_counter()
    subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True)
    return json.loads((folder / "summary.json").read_text())["one_time"], time.perf_counter() - started, load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--job", nargs="*", default=["trainer.max_steps=30", "trainer.num_threads=1"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    out = a.out or REPO / "docs" / "benchmarks" / f"compile-cache-cpu-{time.strftime('%Y-%m-%d')}.md"
    rows, by_kind = [], {"cold": [], "from the job folder": [], "warm local cache": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for r in range(a.repeats):
            cold = work / f"cold{r}"
            once, wall, load = job(cold, work / f"ind-cold{r}", a.job)
            runs = [("cold", once, wall, load)]
            moved = work / f"moved{r}"
            moved.mkdir()
            shutil.copytree(cold / "compile_cache", moved / "compile_cache")
            runs.append(("from the job folder", *job(moved, work / f"ind-node{r}", a.job)))
            runs.append(("warm local cache", *job(work / f"warm{r}", work / f"ind-cold{r}", a.job)))
            for kind, once, wall, load in runs:
                by_kind[kind].append(once["compile_s"])
                rows.append(
                    f"| {r + 1} | {kind} | {once['compile_s']:.2f} | {once['warmup_excess_s']:.2f} | "
                    f"{wall:.1f} | {once['compile_cache'].split(':')[0]} | {load:.2f} |"
                )
    median = {k: statistics.median(v) for k, v in by_kind.items()}
    lines = [
        f"# The compile cache in the job folder ({time.strftime('%Y-%m-%d')})",
        "",
        f"Machine: {os.cpu_count()} cores ({_cpu()}), Python {platform.python_version()}; command: "
        f"`python scripts/bench_compile_cache.py {' '.join(sys.argv[1:])}`; job: `python -m runner "
        f"{' '.join(a.job)} compile=default`.",
        "",
        "| repeat | run | compile s | warm-up excess s | process wall s | cache | load |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        "Median compile seconds: "
        + ", ".join(f"{k} {v:.2f}" for k, v in median.items())
        + f"; from the job folder ×{median['from the job folder'] / median['cold']:.2f} the cold compile "
        f"(range {min(by_kind['from the job folder']):.2f}–{max(by_kind['from the job folder']):.2f} s).",
        "",
    ]
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())


def _cpu() -> str:
    try:
        return next(
            x.split(":", 1)[1].strip()
            for x in Path("/proc/cpuinfo").read_text().splitlines()
            if x.startswith("model name")
        )
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


if __name__ == "__main__":
    main()
