"""The end of a plain multirun: the sweep's table and the command that reports it again (``SweepReport``, a Hydra
callback; docs/configuration.md, "Sweeps"). Only after Hydra's basic launcher (the interleaved launcher and a recipe
search end with their own tables), rank 0 only; a convergence sweep gets its report (``print_convergence_end``). A
report that cannot be written costs one line, never the sweep (an ``error:`` line and status 2 on a full disk).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from runner.objective import BASIC_LAUNCHER, SEARCH_SWEEPER
from runner.report.sweep import jobs_table, load_sweep, load_warning, write_plain_report

MEASURE_KEY = "ablation.measure"  # convergence: the sweep's report is the convergence report


def _not_written(kind: str, e: Exception, sweep: Path, command: str) -> None:
    """A report that could not be written: one line. A full disk or a read-only folder is an ``error:`` line and exit
    status 2 (the jobs' folders are complete; the command writes the report once there is room); anything else a
    plain line, the sweep's status unchanged."""
    import sys

    from runner.checkpoint.write_failures import describe_free, unwritable

    found = unwritable(e, sweep)
    if found is None:
        print(f"{kind}: not written ({type(e).__name__}: {e}); {command} writes it", flush=True)
        return
    free = f" ({describe_free(sweep)})" if "disk" in found[0] else ""
    print(
        f"error: {found[0]}: could not write the {kind} in {sweep}{free}; every job's folder is complete: free space "
        f"there (or make it writable) and run {command}",
        file=sys.stderr,
        flush=True,
    )
    sys.exit(2)


def print_sweep_end(sweep: Path) -> None:
    """Write the report of the plain sweep in ``sweep`` and print its jobs' table, the files and the report
    command; one line instead when the report cannot be written (the jobs' folders are all there is then)."""
    command = f"python -m runner.report {shlex.quote(str(sweep))}"
    try:
        written = write_plain_report(sweep)
        table = jobs_table(sweep)
        busy = load_warning(load_sweep(sweep))
    except Exception as e:  # noqa: BLE001 - the jobs are done and their folders written; the report is extra
        _not_written("sweep report", e, sweep, command)
        return
    lines = ["", f"sweep {sweep}, jobs fastest first:", *table]
    if busy:
        lines.append(f"warning: {busy}")
    lines += [f"wrote {', '.join(str(p) for p in written)}", f"the report again (and after more jobs): {command}"]
    print("\n".join(lines), flush=True)


def print_convergence_end(sweep: Path) -> None:
    """Write the convergence report of ``sweep`` and print its table, the files and the report command (with
    ``--throughput`` where rows need it); one line instead when it cannot be written."""
    from runner.report.convergence import build_variants
    from runner.report.convergence_text import NEEDS_THROUGHPUT, table, write_convergence_report

    command = f"python -m runner.report {shlex.quote(str(sweep))}"
    try:
        rows = build_variants(sweep)
        written = write_convergence_report(sweep, rows=rows)
    except Exception as e:  # noqa: BLE001 - the seeds are done and their folders written; the report is extra
        _not_written("convergence report", e, sweep, command)
        return
    lines = [
        "",
        f"convergence sweep {sweep}, ratios to the baseline:",
        *table(rows),
        f"wrote {', '.join(str(p) for p in written)}",
    ]
    if any(v.verdict == NEEDS_THROUGHPUT for v in rows):
        lines.append(
            f"time to target of the rows that change a step's cost (report.md says how to measure it): "
            f"{command} --throughput <interleaved ablation sweep>"
        )
    else:
        lines.append(f"the report again: {command}")
    print("\n".join(lines), flush=True)


class SweepReport(Callback):
    """Hydra callback (``hydra.callbacks.sweep_report`` in ``conf/config.yaml``): at the end of a basic-launcher
    multirun, ``print_sweep_end`` on its sweep folder (rank 0)."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:  # noqa: D102 - the class says it
        from omegaconf import OmegaConf

        from runner.launch import discover

        if discover().rank != 0 or OmegaConf.select(config, "hydra.launcher._target_") != BASIC_LAUNCHER:
            return
        if OmegaConf.select(config, "hydra.sweeper._target_") == SEARCH_SWEEPER:  # it ends with its own tables
            return
        sweep = Path(str(OmegaConf.select(config, "hydra.sweep.dir")))
        if OmegaConf.select(config, MEASURE_KEY) == "convergence":
            print_convergence_end(sweep)
        else:
            print_sweep_end(sweep)
