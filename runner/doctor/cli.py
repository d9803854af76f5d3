"""``python -m runner.doctor JOB [--verify] ...``: the diagnosis, and with ``--verify`` its measurement."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import runner.doctor as package
from runner.doctor.diagnosis import diagnose
from runner.doctor.job import load_job, render
from runner.doctor.verify import VERIFY_MINUTES, verify, verify_table
from runner.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    """``python -m runner.doctor JOB [--verify] [--minutes M] [--steps N] [--repeats N] [--top N] [--out DIR]``;
    returns the exit status (2: a folder or an option the doctor cannot use)."""
    parser = argparse.ArgumentParser(prog="python -m runner.doctor", description=package.__doc__.split("\n\n")[0])
    parser.add_argument("job", type=Path, help="a job folder (outputs/<date>/<time>) holding summary.json")
    parser.add_argument("--verify", action="store_true", help="run the job and each suggestion, report speed-ups")
    parser.add_argument("--minutes", type=float, default=VERIFY_MINUTES,
                        help=f"--verify measuring time, start-ups excluded (default {VERIFY_MINUTES:g})")
    parser.add_argument("--steps", type=int, help="--verify steps per slice (default: about 4 s of the job)")
    parser.add_argument("--repeats", type=int, default=1, help="--verify processes per configuration (default 1)")
    parser.add_argument("--top", type=int, help="--verify only the first N suggestions (default: all)")
    parser.add_argument("--out", type=Path, help="--verify folder (default <job>/doctor-verify/<date>_<time>)")
    args = parser.parse_args(argv)
    try:
        job = load_job(args.job)
        findings = diagnose(job.summary, job.config, job.metrics)
        print(render(findings, job), flush=True)
        if args.verify:
            trials, out = verify(job, findings, steps=args.steps, repeats=args.repeats, minutes=args.minutes,
                                 out=args.out, top=args.top)
            print("\n".join(["", *verify_table(trials), "", f"wrote {out / 'verify.md'}, {out / 'verify.json'}"]))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
