"""``python -m runner.report <multirun folder>``: the report of a sweep.

Which report a folder gets: the package docstring (runner/report/__init__.py). A folder that cannot be reported
prints ``error: <message>`` and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from runner.report.convergence import is_convergence
from runner.report.convergence_text import write_convergence_report
from runner.report.load import ReportError, is_ablation
from runner.report.sweep import SweepError, load_sweep, load_warning, write_plain_report
from runner.report.write import write_report


def main(argv: list[str] | None = None) -> int:
    """``python -m runner.report SWEEP [--doc PATH [--replication SWEEP2]] [--throughput SWEEP3] [--no-wandb]``.

    Returns the exit status: 0, or 2 for a folder that cannot be reported (``ReportError``, ``SweepError``:
    the message is printed as ``error: ...``); bad arguments exit with argparse's status 2.
    """
    parser = argparse.ArgumentParser(prog="python -m runner.report", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "sweep",
        type=Path,
        help="a multirun folder: an ablation (outputs/ablation/<date>/<time>), "
        "a convergence sweep (outputs/convergence/<date>/<time>) or any "
        "sweep (outputs/multirun/<date>/<time>)",
    )
    parser.add_argument(
        "--doc",
        type=Path,
        help="ablation or convergence: also write the report as a document, e.g. docs/ablation-cpu.md",
    )
    parser.add_argument(
        "--replication",
        type=Path,
        help="with --doc: an independent second sweep of the same job "
        "(convergence: other seeds); the document gets the agreement "
        "table",
    )
    parser.add_argument(
        "--throughput",
        type=Path,
        help="convergence sweep: the interleaved ablation sweep of the same "
        "variants whose samples/s ratios turn samples to target into "
        "time to target",
    )
    parser.add_argument("--no-wandb", action="store_true", help="do not log the W&B table even if the jobs used W&B")
    args = parser.parse_args(argv)
    try:
        if args.replication and not args.doc:
            raise ReportError("--replication adds the agreement table to the document: give --doc PATH too")
        if args.sweep.is_dir() and is_convergence(args.sweep):
            written = write_convergence_report(args.sweep, args.throughput, args.doc, args.replication)
        elif args.throughput:
            raise ReportError("--throughput is for convergence sweeps (+experiment=convergence)")
        elif args.sweep.is_dir() and not is_ablation(args.sweep):
            if args.doc:
                raise ReportError("--doc is for ablation sweeps; the report of this sweep is its report.md")
            written = write_plain_report(args.sweep)
            busy = load_warning(load_sweep(args.sweep))
            if busy:  # stderr: stdout lists the files written
                print(f"warning: {busy}", file=sys.stderr)
        else:
            written = write_report(args.sweep, doc=args.doc, use_wandb=not args.no_wandb, replication=args.replication)
    except (ReportError, SweepError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(f"wrote {p}" for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
