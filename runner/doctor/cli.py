"""``python -m runner.doctor JOB [--verify] ...``: the diagnosis, and with ``--verify`` its measurement."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import runner.doctor as package
from runner import trust
from runner.doctor.diagnosis import Finding, diagnose
from runner.doctor.job import Job, load_job, merge_overrides, render
from runner.doctor.verify import VERIFY_MINUTES, compose_job, verify, verify_plan, verify_table
from runner.errors import ConfigError


def check_verify(job: Job, findings: list[Finding], top: int | None, policy: trust.Policy) -> None:
    """What ``--verify`` would run, checked by ``runner.trust`` before any of it is composed or run: the job folder
    is data (someone else may have written it), so its ``overrides.yaml`` may set no Hydra setting nor use a
    resolver runner does not own, its recorded search path may name folders only, and every configuration
    --verify trains may name runner's own targets only, unless ``policy`` allows more.

    Raises:
        ConfigError: the first refusal (``runner.trust``), naming the key, the file and how to allow it.
    """
    hydra_dir = job.folder / ".hydra"
    trust.check_package(job.folder, policy)
    trust.check_overrides(job.overrides, policy, hydra_dir / "overrides.yaml")
    trust.check_searchpath(job.searchpath, policy, hydra_dir / "hydra.yaml")
    for t in verify_plan(job, findings, top):
        cfg = compose_job(job, merge_overrides(job.overrides, t.overrides))
        trust.check_config(cfg, policy, hydra_dir / "overrides.yaml")


def main(argv: list[str] | None = None) -> int:
    """``python -m runner.doctor JOB [--verify] [--minutes M] [--steps N] [--repeats N] [--top N] [--out DIR]``;
    returns the exit status (2: a folder or an option the doctor cannot use). ``--verify`` on a diagnosis that
    suggests no override says so in one line and returns 0: nothing runs."""
    parser = argparse.ArgumentParser(prog="python -m runner.doctor", description=package.__doc__.split("\n\n")[0])
    parser.add_argument("job", type=Path, help="a job folder (outputs/<date>/<time>) holding summary.json")
    parser.add_argument("--verify", action="store_true", help="run the job and each suggestion, report speed-ups")
    parser.add_argument(
        "--minutes",
        type=float,
        default=VERIFY_MINUTES,
        help=f"--verify measuring time, start-ups excluded (default {VERIFY_MINUTES:g})",
    )
    parser.add_argument("--steps", type=int, help="--verify steps per slice (default: about 4 s of the job)")
    parser.add_argument("--repeats", type=int, default=1, help="--verify processes per configuration (default 1)")
    parser.add_argument("--top", type=int, help="--verify only the first N suggestions (default: all)")
    parser.add_argument("--out", type=Path, help="--verify folder (default <job>/doctor-verify/<date>_<time>)")
    trust.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        job = load_job(args.job)
        findings = diagnose(job.summary, job.config, job.metrics)
        print(render(findings, job), flush=True)
        if args.verify and len(verify_plan(job, findings)) == 1:  # only the job's own rerun: nothing to compare
            print(f"\nnothing to verify: the diagnosis of {job.folder} suggests no override to measure", flush=True)
        elif args.verify:
            check_verify(job, findings, args.top, trust.Policy.make(args.trust, args.allow_target, args.job))
            trials, out = verify(
                job, findings, steps=args.steps, repeats=args.repeats, minutes=args.minutes, out=args.out, top=args.top
            )
            print("\n".join(["", *verify_table(trials), "", f"wrote {out / 'verify.md'}, {out / 'verify.json'}"]))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C during --verify: its processes were stopped, interleave.json kept
        print(
            "error: interrupted: --verify stopped; what it measured is in its folder's interleave.json", file=sys.stderr
        )
        return 130
    return 0
