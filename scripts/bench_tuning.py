"""The three tuners and the speed doctor on two jobs of this machine, one after the other; writes
docs/benchmarks/tuning.md and the tuners' tables and plots under docs/benchmarks/tuning/ (markdown and PNG only:
the tuners' raw CSV/JSON and logs stay out of the tree).

    python scripts/bench_tuning.py                        # resnet18 on CIFAR-10 and nanoGPT's Shakespeare GPT
    python scripts/bench_tuning.py --jobs gpt --out /tmp/tuning.md

Each tuner is a plain ``python -m runner.tune <tuner> --out docs/benchmarks/tuning/<job>/<tuner> <the job's overrides>``
process; the doctor reads a short plain run of the job (``python -m runner <overrides>``, then
``python -m runner.doctor <its folder>``). The machine's load average is recorded before and after each
command: a busy machine changes every speed figure (and the tuners' picks).
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DATA = os.environ.get("RUNNER_DATA_ROOT", str(REPO.parent / "shared" / "data"))

#: job name -> (what it is, its overrides of python -m runner)
JOBS = {
    "resnet18-cifar10": (
        "torchvision resnet18 (CIFAR stem) on the real CIFAR-10, SGD, batch 64",
        ["model=resnet18", "model.cifar_stem=true", "data=cifar10", f"data.root={DATA}", "logger=none"],
    ),
    "gpt-shakespeare": (
        "nanoGPT's CPU Shakespeare GPT (+experiment=shakespeare_char: 4 layers, 128 wide, block 64, batch 12, AdamW)",
        ["+experiment=shakespeare_char", "logger=none"],
    ),  # the embedded corpus
}
TUNERS = ("batch_size", "lr", "dataloader")  # runner.tune.TUNERS, in this order
#: per tuner: 10 measured steps per configuration instead of 5 (figures a few per cent apart decide the pick)
TUNE = {"batch_size": ["tune.measure_steps=10"], "lr": [], "dataloader": ["tune.measure_steps=10"]}
#: the short plain run the doctor diagnoses (per job)
DOCTOR_RUN = {
    "resnet18-cifar10": ["trainer.max_steps=40", "trainer.warmup_steps=5", "trainer.eval_max_batches=4"],
    "gpt-shakespeare": [
        "trainer.max_steps=200",
        "trainer.warmup_steps=20",
        "trainer.eval_every=null",
        "trainer.eval_max_batches=20",
    ],
}


def shown(cmd: list[str]) -> str:
    """The command as a user types it (``python`` for this interpreter, the data root as ``$DATA``)."""
    return " ".join(shlex.quote(c) for c in ["python", *cmd[1:]]).replace(DATA, "$DATA")


def call(cmd: list[str]) -> dict:
    """Run ``cmd`` from the repository root; its output, wall time and the load average around it."""
    before = os.getloadavg()[0]
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "WANDB_MODE": "offline"})
    if proc.returncode != 0:
        sys.exit(f"failed: {shown(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return {
        "command": shown(cmd),
        "stdout": proc.stdout,
        "wall_s": time.perf_counter() - started,
        "load": (before, os.getloadavg()[0]),
    }


def section(job: str, out_dir: Path, doc: Path) -> list[str]:
    what, overrides = JOBS[job]
    lines = [f"## {job}", "", what + ".", ""]
    for tuner in TUNERS:
        folder = out_dir / job / tuner
        r = call([sys.executable, "-m", "runner.tune", tuner, "--out", str(folder), *overrides, *TUNE[tuner]])
        shutil.rmtree(folder / ".hydra", ignore_errors=True)  # the run's composed config: not part of the report
        for raw in (f"{tuner}.csv", f"{tuner}.json", "runner.log"):  # raw figures and logs stay out of the tree
            (folder / raw).unlink(missing_ok=True)
        table = (folder / f"{tuner}.md").read_text().strip().removeprefix(f"# runner.tune {tuner}").strip()
        image = (folder / f"{tuner}.png").relative_to(doc.parent)
        lines += [
            f"### `tune {tuner}`",
            "",
            f"`{r['command'].replace(str(REPO) + '/', '')}`",
            "",
            f"Wall time {r['wall_s']:.0f} s; load average {r['load'][0]:.1f} before, {r['load'][1]:.1f} after.",
            "",
            table,
            "",
            f"![{tuner}]({image})",
            "",
        ]
    run_dir = REPO / "outputs" / "bench_tuning" / time.strftime("%Y-%m-%d_%H-%M-%S") / job
    run = call(
        [
            sys.executable,
            "-m",
            "runner",
            *overrides,
            *DOCTOR_RUN[job],
            "trainer.progress=off",
            f"hydra.run.dir={run_dir}",
        ]
    )
    doctor = call([sys.executable, "-m", "runner.doctor", str(run_dir)])
    lines += [
        "### The speed doctor",
        "",
        f"A short run, `{run['command'].rsplit(' hydra.run.dir=', 1)[0]}` ({run['wall_s']:.0f} s, load "
        f"average {run['load'][0]:.1f} before, {run['load'][1]:.1f} after), then "
        f"`python -m runner.doctor <its folder>`:",
        "",
        "```",
        doctor["stdout"].strip(),
        "```",
        "",
    ]
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", nargs="+", default=list(JOBS), choices=list(JOBS))
    p.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks" / "tuning.md")
    args = p.parse_args()
    sys.path.insert(0, str(REPO))
    from runner.measure import hardware

    machine = hardware.describe_machine()
    started = time.strftime("%Y-%m-%d %H:%M")
    body = []
    for job in args.jobs:
        body += section(job, args.out.parent / args.out.stem, args.out)
    lines = [
        "# Tuners and the speed doctor on this machine",
        "",
        f"Machine: {machine.get('cpu') or platform.processor()} ({machine.get('cpu_cores')} cores, "
        f"{machine.get('memory_gib')} GiB), no GPU; torch "
        f"{machine.get('torch')}; Python {platform.python_version()}. Ran {started} to "
        f"{time.strftime('%H:%M')}.",
        "",
        f"Command: `python scripts/bench_tuning.py {' '.join(sys.argv[1:])}`".rstrip() + " — it runs every "
        "command below one after the other and writes this file; the tables and plots are the tuners' own "
        "outputs (`<tuner>.md`, `<tuner>.png`).",
        "",
        "Every figure is one short measurement on a shared 2-core machine: the load averages say how busy it "
        "was. A tuner's pick is as good as its measurements; on a quiet machine raise `tune.measure_steps` "
        "before trusting a difference of a few per cent.",
        "",
        *body,
    ]
    args.out.write_text("\n".join(lines).rstrip() + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
