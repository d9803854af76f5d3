"""``hydra/launcher=interleaved``: a Hydra launcher that measures a sweep's jobs side by side in time.

It prepares every job as Hydra's basic launcher would (its folder, ``.hydra/``, the config resolved in the job's
context), hands them to runner/compare/ and writes the report at the end, also after Ctrl-C (docs/ablation.md,
"Interleaved measurement").

Hydra instantiates launchers only from the ``hydra_plugins`` namespace, found by scanning installed packages,
which an editable install does not expose (a ``package-dir`` mapping is invisible to ``pkgutil``): ``register``,
called by ``python -m runner`` before Hydra starts, enters this class into Hydra's plugin registry as ``TARGET``.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher
from omegaconf import DictConfig, OmegaConf, open_dict

#: The name conf/hydra/launcher/interleaved.yaml gives as ``_target_``.
TARGET = "hydra_plugins.runner_interleaved.InterleavedLauncher"


def register() -> None:
    """Enter ``InterleavedLauncher`` into Hydra's plugin registry under ``TARGET`` (see the module docstring)."""
    from hydra.core.plugins import Plugins

    Plugins.instance().class_name_to_class[TARGET] = InterleavedLauncher


class InterleavedLauncher(Launcher):
    """Hydra's ``Launcher`` interface (``setup``, then ``launch`` with every job's overrides)."""

    def __init__(self) -> None:
        self.config: DictConfig | None = None
        self.hydra_context: Any = None
        self.task_function: Any = None

    def setup(self, *, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        cfg = self.config
        from runner.compare.schedule import settings_problem

        if problem := settings_problem(cfg.interleave):
            _refuse(problem)
        ranks = _ranks(cfg)  # a sweep of single-process jobs under torchrun: refused first, whatever else is wrong
        from runner.compare.server import check_socket_dir
        from runner.errors import ConfigError

        try:
            check_socket_dir()  # every job is forked from the job server
        except ConfigError as e:
            _refuse(str(e))
        from hydra.core.utils import configure_log, setup_globals

        setup_globals()
        configure_log(cfg.hydra.hydra_logging, cfg.hydra.verbose)
        sweep = Path(str(cfg.hydra.sweep.dir)).resolve()
        sweep.mkdir(parents=True, exist_ok=True)
        returns, prepared = [], []
        for i, overrides in enumerate(job_overrides):
            ret, job = self._prepare(list(overrides), initial_job_idx + i)
            returns.append(ret)
            prepared.append(job)
        return self._conduct(sweep, job_overrides, initial_job_idx, returns, prepared, ranks)

    def _conduct(
        self, sweep: Path, job_overrides, first: int, returns: list, prepared: list, ranks: Any
    ) -> list[JobReturn]:
        from runner import compare
        from runner.compare import Job
        from runner.report.load import kind_of

        ablation = any(job and job[0].ablation.variant for job in prepared)
        ref_index = self._reference_index(prepared, ablation)
        ref_cfg, ref_folder = prepared[ref_index]
        reference = _name(ref_folder, sweep)
        k = self.config.interleave.processes
        copy_overrides = list(job_overrides[ref_index])
        if ablation:
            copy_overrides = _repeat(copy_overrides, k)
        subdir = None if ablation else f"{reference}-aa"
        copy_ret, copy_job = self._prepare(copy_overrides, first + len(job_overrides), subdir)
        by_variant = {job[0].ablation.variant: _name(job[1], sweep) for job in prepared if job}
        jobs, index = [], first + len(job_overrides) + 1
        for overrides, job in [*zip(job_overrides, prepared), (copy_overrides, copy_job)]:
            if job is None:
                continue
            cfg, folder = job
            name = _name(folder, sweep)
            ref = None if name == reference else reference
            if ablation and ref and kind_of(cfg.ablation.variant) == "leave-one-out" and "fast" in by_variant:
                ref = by_variant["fast"]
            jobs.append(Job(name, cfg, folder, ref))
            start = cfg.ablation.repeat if ablation else 0
            for r in range(1, k):  # further processes of the same configuration (the unit of replication)
                more = _repeat(list(overrides), start + r) if ablation else list(overrides)
                _, extra = self._prepare(more, index, None if ablation else f"{name}-p{r}")
                index += 1
                if extra is not None:
                    jobs.append(Job(_name(extra[1], sweep), extra[0], extra[1], ref, config=name))
        aa = _name(copy_job[1], sweep) if copy_job else None
        per = f"{k} processes per configuration" if k > 1 else "each in its own process"
        if ranks is not None:
            per += f", each of {ranks.world_size} ranks (torchrun)"
        if ranks is None or ranks.leader:
            print(
                f"interleave: {len(jobs)} jobs (the reference {reference} and its copy {aa} included), "
                f"{per}; the others wait while one trains",
                flush=True,
            )
        try:
            result = compare.measure(jobs, self.config.interleave, sweep, reference, aa, ranks=ranks)
        except KeyboardInterrupt:
            _interrupted(sweep, ablation, ranks)
        if ranks is None or ranks.leader:
            _note_failures(result.failed)
        if ranks is not None and not ranks.leader:  # rank 0 holds the figures and writes the report
            for ret in [*returns, copy_ret]:
                ret.status, ret.return_value = JobStatus.COMPLETED, None
            return returns
        for ret, job in zip([*returns, copy_ret], [*prepared, copy_job]):
            summary_path = job[1] / "summary.json" if job else None
            value = None
            if summary_path is not None and summary_path.is_file():
                value = json.loads(summary_path.read_text()).get("samples_per_sec")
            ret.status, ret.return_value = JobStatus.COMPLETED, value
        if not ablation:
            _plain_report(sweep)
        return returns  # the copy is the launcher's own: Hydra's sweeper knows only the jobs it asked for

    def _reference_index(self, prepared: list, ablation: bool) -> int:
        if ablation:
            for i, job in enumerate(prepared):
                if job and job[0].ablation.variant == "baseline" and job[0].ablation.repeat == 0:
                    return i
            _refuse(
                "an interleaved ablation compares every configuration with the baseline: include baseline in "
                "ablation/variant=..."
            )
        index = self.config.interleave.reference
        index = 0 if index is None else index
        if not 0 <= index < len(prepared):
            _refuse(f"interleave.reference={index}: the sweep has jobs 0..{len(prepared) - 1}")
        if prepared[index] is None:
            _refuse(f"interleave.reference={index}: that job does not run here (see its not_run.json)")
        return index

    def _prepare(self, overrides: list[str], idx: int, subdir: str | None = None) -> tuple[JobReturn, Any]:
        """Make job ``idx``'s folder and config as Hydra's basic launcher would; return Hydra's record of it
        and (resolved config, folder), or None for a job that does not run here (not_run.json)."""
        from hydra.core.utils import run_job

        sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with open_dict(sweep_config):
            sweep_config.hydra.job.id = idx
            sweep_config.hydra.job.num = idx
            if subdir is not None:
                sweep_config.hydra.sweep.subdir = subdir
        ret = run_job(
            hydra_context=self.hydra_context,
            task_function=_resolve_job,
            config=sweep_config,
            job_dir_key="hydra.sweep.dir",
            job_subdir_key="hydra.sweep.subdir",
        )
        job = ret._return_value if ret.status == JobStatus.COMPLETED else None
        return ret, job


def _ranks(cfg: DictConfig):
    """Under torchrun, this rank's conductor's place among the ranks' (runner/compare/ranks.py); None with one
    process. Every job of the sweep then runs as a job of all the ranks, so it must be distributed."""
    from runner import launch
    from runner.compare.ranks import Ranks

    layout = launch.discover()
    if layout.world_size == 1:
        return None
    if cfg.distributed.name not in ("ddp", "fsdp"):
        _refuse(
            f"launched as {layout.world_size} processes ({layout.launcher}) but distributed="
            f"{cfg.distributed.name}: every job of an interleaved sweep under torchrun runs on all the ranks; "
            f"add distributed=ddp (or fsdp)"
        )
    if layout.launcher != "torchrun":
        _refuse(
            f"an interleaved sweep of {layout.world_size} processes runs under torchrun only ({layout.launcher} "
            f"tasks cannot share its rendezvous); start it with torchrun, or as one process"
        )
    return Ranks.join(cfg.distributed.timeout_s)


def _resolve_job(cfg: DictConfig) -> tuple[DictConfig, Path] | None:
    """Inside Hydra's job context: the job's config resolved (``${hydra:...}``, ``${now:...}`` mean what they
    mean in this job) and its folder; None for an ablation variant that does not run here."""
    from hydra.core.hydra_config import HydraConfig

    from runner.sweeps import ablation
    from runner.techniques import compile_cache

    folder = Path(HydraConfig.get().runtime.output_dir)
    if ablation.not_run(cfg, folder) is not None:  # e.g. a CUDA-only variant: not_run.json written
        return None
    job_cfg = copy.deepcopy(cfg)
    OmegaConf.resolve(job_cfg)
    job_cfg.trainer.progress = "off"  # the conductor prints one line per pass
    shared = compile_cache.shared_folder(job_cfg)  # the sweep's, found through Hydra, which the job process lacks
    job_cfg.compile.cache = str(shared) if shared else None
    return job_cfg, folder


def _repeat(overrides: list[str], repeat: int) -> list[str]:
    """An ablation job's overrides with ``ablation.repeat`` set (its folder ``<variant>/r<repeat>``)."""
    return [o for o in overrides if not o.startswith("ablation.repeat=")] + [f"ablation.repeat={repeat}"]


def _name(folder: Path, sweep: Path) -> str:
    return str(folder.relative_to(sweep)) if folder.is_relative_to(sweep) else str(folder)


def _refuse(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


#: The jobs of this process's sweeps that failed: ``python -m runner`` exits 1 after the sweep when there are any.
FAILED: dict[str, str] = {}


def _note_failures(failed: dict[str, str]) -> None:
    """Remember the jobs that failed (their one-line reasons went to the console as they failed): ``python -m
    runner`` names them and exits 1 once the sweep's report is written (``failures``)."""
    FAILED.update({name: status for name, status in failed.items() if status.startswith("failed")})


def failures() -> str | None:
    """The line that ends a sweep some of whose jobs failed, or None."""
    if not FAILED:
        return None
    return (
        f"interleave: {len(FAILED)} job(s) failed ({', '.join(sorted(FAILED))}): their output is in their "
        f"folders' job.log; exit status 1"
    )


def _interrupted(sweep: Path, ablation: bool, ranks: Any) -> None:
    """Ctrl-C: every job was stopped and ``interleave.json`` holds what was measured; write the report from it
    (an unfinished job's figures come from its slices) and exit 130."""
    if ranks is None or ranks.leader:
        print(
            "interleave: interrupted; the report is written from what was measured (interleave.json)",
            file=sys.stderr,
            flush=True,
        )
        if ablation:
            from runner.report import ReportError, write_report

            try:
                written = write_report(sweep, use_wandb=False)
                print("ablation report: " + ", ".join(str(p) for p in written), flush=True)
            except ReportError as e:
                print(f"error: {e}", file=sys.stderr, flush=True)
        else:
            _plain_report(sweep)
    sys.exit(130)


def _plain_report(sweep: Path) -> None:
    from runner.report.sweep import SweepError, write_plain_report

    try:
        written = write_plain_report(sweep)
    except SweepError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return
    print("interleave report: " + ", ".join(str(p) for p in written), flush=True)
