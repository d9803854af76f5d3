"""``python -m runner.doctor JOB [--verify] ...``: the diagnosis, and with ``--verify`` its measurement."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import runner.doctor as package
from runner.doctor.diagnosis import VERIFY_MEASURED_STEPS, diagnose
from runner.doctor.job import load_job, render
from runner.doctor.verify import verify, verify_table
from runner.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    """``python -m runner.doctor JOB [--verify] [--steps N] [--repeats N] [--top N] [--out DIR]``; returns the exit
    status (2: a folder or an option the doctor cannot use)."""
    parser = argparse.ArgumentParser(prog="python -m runner.doctor", description=package.__doc__.split("\n\n")[0])
    parser.add_argument("job", type=Path, help="a job folder (outputs/<date>/<time>) holding summary.json")
    parser.add_argument("--verify", action="store_true", help="run the job and each suggestion, report speed-ups")
    parser.add_argument("--steps", type=int, help="steps per --verify run (default: the job's trainer.max_steps, "
                                                  f"else its warm-up + {VERIFY_MEASURED_STEPS})")
    parser.add_argument("--repeats", type=int, default=3, help="--verify repeats per configuration (default 3)")
    parser.add_argument("--top", type=int, help="--verify only the first N suggestions (default: all)")
    parser.add_argument("--out", type=Path, help="--verify folder (default <job>/doctor-verify/<date>_<time>)")
    args = parser.parse_args(argv)
    try:
        job = load_job(args.job)
        findings = diagnose(job.summary, job.config, job.metrics)
        print(render(findings, job), flush=True)
        if args.verify:
            trials, out = verify(job, findings, steps=args.steps, repeats=args.repeats, out=args.out, top=args.top)
            print("\n".join(["", *verify_table(trials), "", f"wrote {out / 'verify.md'}, {out / 'verify.json'}"]))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
