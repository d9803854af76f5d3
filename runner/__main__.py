"""``python -m runner [overrides]``: compose the config with Hydra and train. Nothing else lives here."""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from runner import CONF_DIR, objective
from runner.errors import EXIT_PREEMPTED, ConfigError, Preempted, TrainingDiverged
from runner.launch import prepare_process, record_if_elastic
from runner.sweeps.interleaved import register as register_interleaved_launcher
from runner.techniques import variants

variants.register()
register_interleaved_launcher()  # hydra/launcher=interleaved (runner/sweeps/interleaved.py)


def _search_sweeper(**settings):
    """``hydra/sweeper=search`` (runner/sweeps/search.py), imported only when a search starts (Optuna is heavy)."""
    from runner.sweeps.search import make_sweeper

    return make_sweeper(**settings)


def _register_search_sweeper() -> None:
    from hydra.core.plugins import Plugins

    from runner.objective import SEARCH_SWEEPER

    Plugins.instance().class_name_to_class[SEARCH_SWEEPER] = _search_sweeper


_register_search_sweeper()


def _one_line_compose_errors() -> None:
    """Hydra's compose errors (a misspelt key, a value of the wrong type, an unknown option) become runner's one
    ``error:`` line with the fix (``runner.engine.validate.compose_error_line``), exit status 2, by wrapping
    ``hydra._internal.utils.run_and_report`` (Hydra 1.3); every other error is Hydra's as before."""
    import hydra._internal.utils as hydra_utils
    from hydra.errors import ConfigCompositionException

    from runner.engine.validate import compose_error_line

    report = getattr(hydra_utils, "run_and_report", None)
    if report is None or getattr(report, "runner_one_line", False):  # another Hydra: its own message stays
        return

    def run_and_report(func):
        def translated():
            try:
                return func()
            except (ConfigCompositionException, AssertionError) as e:
                message = compose_error_line(e, sys.argv[1:])
                if message is None:
                    raise
                print(f"error: {message}", file=sys.stderr)
                sys.exit(2)
            except KeyboardInterrupt:  # while composing or starting a launcher (a job's own Ctrl-C is _train's)
                print("error: interrupted (Ctrl-C) before any job started training", file=sys.stderr)
                sys.exit(130)
            except Exception as e:  # a full disk or a read-only folder, at any write (Hydra's .hydra/ too)
                message = _unwritable(e)
                if message is None:
                    raise
                print(f"error: {message}", file=sys.stderr)
                sys.exit(2)

        return report(translated)

    run_and_report.runner_one_line = True  # type: ignore[attr-defined]
    hydra_utils.run_and_report = run_and_report


# CONF_DIR: the checkout's conf/, or the copy a regular install put inside the package (an absolute path, so
# both work); a user's own config folder joins it with --config-dir or hydra.searchpath (README).
@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> float | None:
    """Train the composed job; return what a Hydra sweeper optimizes: the summary's ``optimized_metric``
    (runner/objective.py: a run that missed its target returns twice what it spent), samples/s when it is null.

    Exit status: 2 for bad input (``ConfigError``) or an output that cannot be written (a full disk), 3 for a
    diverged run (``TrainingDiverged``; inside a multirun the sweep goes on and the job returns None, not a figure),
    75 after a preemption checkpoint (a signal or Ctrl-C), 130 after a second Ctrl-C (no checkpoint).
    """
    from runner.launch import discover
    from runner.track import console_to_log, job_folder

    # runner.log (Hydra's job log, hydra.job.name=runner) holds the run's console too, on rank 0
    with console_to_log(job_folder() / "runner.log" if discover().rank == 0 else None):
        return _train(cfg)


def _train(cfg: DictConfig) -> float | None:
    from runner.engine.validate import validate
    from runner.track import sweep_group

    try:
        validate(cfg)  # before the engine (torch) is imported: a config mistake is reported in about a second
        from runner.engine.train import train

        summary = train(cfg, on_evaluation=_pruning(cfg))
        if cfg.trainer.doctor and cfg.ablation.variant is None:
            _diagnose(warnings_shown=cfg.trainer.progress != "off")
        return objective.value(summary, cfg.optimized_metric)
    except ConfigError as e:
        from runner.engine.jobdir import undo_refused_run

        print(f"error: {e}", file=sys.stderr)
        undo_refused_run()  # a refused run leaves no folder, and a finished run's .hydra/ as it was
        sys.exit(2)
    except TrainingDiverged as e:
        print(f"error: {e}", file=sys.stderr)
        if sweep_group() is not None:
            return None
        sys.exit(3)
    except Preempted:  # rank 0 printed where the checkpoint is and the command that resumes
        sys.exit(EXIT_PREEMPTED)
    except KeyboardInterrupt:  # a second Ctrl-C, or one before training (the first checkpoints: checkpoint/preempt.py)
        from runner.track import job_folder

        print(
            f"error: interrupted: stopped at once, without a checkpoint (a second Ctrl-C, or one before training "
            f"started); the last complete checkpoint, if any, is intact and the same command with "
            f"hydra.run.dir={job_folder().resolve()} resumes from it",
            file=sys.stderr,
        )
        sys.exit(130)


def _unwritable(e: BaseException) -> str | None:
    """The one line for an output that could not be written (a full disk, a read-only or foreign folder): what,
    where, the last complete checkpoint (kept: checkpoints are written to a partial folder and renamed) and the
    command that resumes from it; None for any other failure."""
    from pathlib import Path

    from runner.checkpoint import FOLDER, latest, write_failures
    from runner.engine.jobdir import started_folder
    from runner.track import job_folder

    try:
        job: Path | None = job_folder().resolve()
    except Exception:  # noqa: BLE001 - Hydra's run ended (it resets its config): the folder runner started it in
        job = started_folder()
        job = job.resolve() if job is not None else None
    found = write_failures.unwritable(e, job or Path.cwd())
    if found is None:
        return None
    why, path = found
    where = path or job or Path.cwd()
    free = f" ({write_failures.describe_free(Path(where))})" if "disk" in why else ""
    fix = "free space there" if "disk" in why else f"make {Path(where).parent} writable"
    kept = latest(job / FOLDER) if job is not None and (job / FOLDER).is_dir() else None
    if kept is not None:
        then = (
            f"the last complete checkpoint, {kept}, is kept; {fix} and run the same command with "
            f"hydra.run.dir={job} to resume from it"
        )
    else:
        then = f"no checkpoint was written; {fix} (or run into another folder: hydra.run.dir) and run it again"
    return f"{why}: could not write {where}{free}; {then}"


def _pruning(cfg: DictConfig):
    """A recipe search's pruner for this trial (runner/sweeps/pruning.py), or None: only a search with
    ``hydra.sweeper.pruner`` set imports Optuna here."""
    import os

    from hydra.core.hydra_config import HydraConfig

    from runner.objective import SEARCH_SWEEPER, TRIAL_ENV

    if not HydraConfig.initialized() or (
        (HydraConfig.get().get("sweeper") or {}).get("_target_") != SEARCH_SWEEPER and not os.environ.get(TRIAL_ENV)
    ):  # a trial in a process of its own
        return None
    from runner.sweeps.pruning import listener

    return listener(cfg)


def _diagnose(warnings_shown: bool) -> None:
    """Rank 0 prints the speed doctor's diagnosis of the job just trained (runner/doctor/); a diagnosis
    that fails costs one line, never the finished run."""
    from runner import doctor
    from runner.launch import discover
    from runner.track import job_folder

    if discover().rank != 0:
        return
    try:
        print("\n" + doctor.report(job_folder(), warnings_shown), flush=True)
    except Exception as e:  # noqa: BLE001 - the run is done and its summary written; the diagnosis is extra
        print(f"speed doctor: no diagnosis ({type(e).__name__}: {e})", file=sys.stderr, flush=True)


def run(argv: list[str] | None = None) -> int:
    """``python -m runner ARGV`` in this process; returns the exit status (0, 1, 2, 3, 75 or 130, as ``main``
    says) instead of leaving the interpreter, so tests and scripts drive the command line without a new process.
    ``argv`` defaults to ``sys.argv[1:]``; Hydra reads ``sys.argv``, which is restored after."""
    saved, argv = sys.argv, (sys.argv[1:] if argv is None else list(argv))
    sys.argv = [saved[0] if saved else "runner", *argv]
    try:
        try:  # under torchrun/srun: full tracebacks, stack dumps, ranks > 0 kept out of outputs/
            prepare_process(sys.argv)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        _one_line_compose_errors()
        record_if_elastic(main)()  # under torchrun: a failure's traceback also goes to torchrun's error summary
        from runner.sweeps.interleaved import failures

        if (line := failures()) is not None:  # an interleaved sweep with a failed job: its report is written first
            print(line, file=sys.stderr)
            return 1
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)  # sys.exit("message"), as the interpreter would print it
        return 1
    finally:
        sys.argv = saved


if __name__ == "__main__":
    sys.exit(run())
