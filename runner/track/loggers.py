"""The loggers ``logger=`` picks (``runner.track.Tracker`` holds them on rank 0): W&B, TensorBoard, MLflow and
``metrics.csv``. Each is a ``Logger``: it takes every metrics row (``log``), the summary at the end (``finish``) or the
failure (``abort``); the rows' figures go under ``runner.track.records.WANDB_KEYS``'s names (``perf/samples_per_sec``),
the same in every logger. A new logger is one class here and one line in ``Tracker``.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import os
import time
import warnings
from pathlib import Path
from typing import Any, Iterator, Protocol

from omegaconf import DictConfig, OmegaConf

from runner.errors import EXIT_PREEMPTED
from runner.files import open_own, own_folder
from runner.track.records import panel_figures, reachable, summary_figures, to_json


class Logger(Protocol):
    """What ``runner.track.Tracker`` asks of a logger (torchtitan's ``BaseLogger``)."""

    def log(self, row: dict[str, Any]) -> None: ...  # one metrics.jsonl row (step, loss, samples_per_sec, ...)

    def finish(self, summary: dict[str, Any]) -> None: ...  # the run's summary.json; close the run

    def abort(self, exit_code: int = 1) -> None: ...  # a failure or preemption: close the run, no summary


class WandbLogger:
    """Weights & Biases (``logger=wandb``, the default): one run per job in ``<job>/wandb`` (``_start_wandb``), rows
    at ``trainer/step``, the summary's figures in the run's summary; ``run_id`` continues it on a resume."""

    def __init__(self, cfg: DictConfig, job_dir: Path, resolved: dict, group: str | None, run_id: str | None = None):
        self.run = _start_wandb(cfg, job_dir, resolved, group, run_id)

    @property
    def run_id(self) -> str:
        return self.run.id

    def log(self, row: dict[str, Any]) -> None:  # noqa: D102 - the class says it
        self.run.log(panel_figures(row) | {"trainer/step": row["step"]})

    def finish(self, summary: dict[str, Any]) -> None:  # noqa: D102
        self.run.summary.update({k: v for k, v in summary.items() if k != "config"})
        self.run.finish()

    def abort(self, exit_code: int = 1) -> None:  # noqa: D102
        self.run.finish(exit_code=exit_code)


def wandb_api_key() -> str | None:
    """The API key W&B itself would use: ``WANDB_API_KEY``, or the one ``wandb login`` stored (``~/.netrc``,
    ``$NETRC``, ``_netrc`` on Windows, for ``WANDB_BASE_URL``'s host), through wandb's own lookup."""
    if os.environ.get("WANDB_API_KEY"):
        return os.environ["WANDB_API_KEY"]
    import wandb

    try:
        # wandb.api.api_key is wandb's own, instant lookup (wandb.login(prompt=False) takes seconds and
        # prints); its deprecation notice goes to stderr, which is muted for this one call
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            return wandb.api.api_key
    except Exception:  # noqa: BLE001 - a broken settings file means "no key", never a failed run
        return None


_offline_notice_shown = False  # the offline notice is printed once per process (once per sweep)


def wandb_offline_reason() -> str | None:
    """Why W&B cannot log online right now, or None when it can try: no API key (``WANDB_API_KEY`` or
    ``wandb login``), or ``WANDB_BASE_URL`` (default https://api.wandb.ai) unreachable within 3 s."""
    base_url = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
    if wandb_api_key() is None:
        return "no API key found (WANDB_API_KEY or `wandb login`)"
    if not reachable(base_url):
        return f"{base_url} cannot be reached"
    return None


def _wandb_mode(job_dir: Path, group: str | None) -> str | None:
    """``WANDB_MODE`` when set; else ``offline`` when ``wandb_offline_reason`` gives one (said once per process,
    with the ``wandb sync`` command that uploads the runs later); else None (online)."""
    global _offline_notice_shown
    mode = os.environ.get("WANDB_MODE") or None
    if mode is not None:
        return mode
    why = wandb_offline_reason()
    if why is None:
        return None
    if not _offline_notice_shown:
        runs = (job_dir.parent / "*" if group else job_dir) / "wandb" / "offline-run-*"
        print(f"W&B: {why}, logging offline; upload later with `wandb sync {runs}`", flush=True)
        _offline_notice_shown = True
    return "offline"


def _start_wandb(cfg: DictConfig, job_dir: Path, resolved: dict, group: str | None, run_id: str | None = None):
    """Start (or, with ``run_id``, continue: ``resume="allow"``) a W&B run in ``<job_dir>/wandb``, grouped by
    ``group`` (the sweep, in multirun). The mode follows ``_wandb_mode``; an online start that fails anyway falls
    back to offline with one line saying why, so tracking never costs the run. W&B's own start-up and closing
    lines are silenced (``silent=True``; runner prints the ``wandb sync`` command), its warnings and errors not."""
    import wandb

    mode = _wandb_mode(job_dir, group)
    kwargs = dict(
        project=cfg.project,
        entity=cfg.entity,
        tags=list(cfg.tags),
        group=group,
        dir=str(job_dir),
        config=resolved,
        name=f"{group}/{job_dir.name}" if group else None,
        id=run_id,
        resume="allow" if run_id else None,
    )
    settings = dict(quiet=True, silent=True, console="off", x_disable_stats=True)
    try:
        run = wandb.init(mode=mode, settings=wandb.Settings(**settings, init_timeout=30.0), **kwargs)
    except Exception as e:  # noqa: BLE001 - wandb raises CommError, UsageError, AuthenticationError, ...
        if mode == "offline":
            raise
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        print(f"W&B: online start failed ({first}); logging offline instead", flush=True)
        run = wandb.init(mode="offline", settings=wandb.Settings(**settings), **kwargs)
    run.define_metric("trainer/step")
    run.define_metric("*", step_metric="trainer/step")
    return run


class TensorBoardLogger:
    """Event files in ``log_dir`` (``torch.utils.tensorboard.SummaryWriter``): every row's figures as scalars
    against the optimizer step, the resolved config as text, the summary's numbers as ``summary/<key>`` scalars at
    the last step and the whole summary as text. A run resumed from the checkpoint of ``resume_step`` purges the
    events after that step (TensorBoard's ``purge_step``), so the figures logged again are not drawn twice."""

    def __init__(self, log_dir: Path, resolved: dict, resume_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(
            str(own_folder(log_dir)),  # a link planted at tensorboard/ is not followed
            purge_step=None if resume_step is None else resume_step + 1,
        )
        self.writer.add_text("config", _code_block(OmegaConf.to_yaml(resolved)), global_step=0)
        self.step = 0

    def log(self, row: dict[str, Any]) -> None:  # noqa: D102 - the class says it
        self.step = row["step"]
        for key, value in panel_figures(row).items():
            self.writer.add_scalar(key, value, global_step=row["step"])
        self.writer.flush()

    def finish(self, summary: dict[str, Any]) -> None:  # noqa: D102
        step = summary.get("steps") or self.step
        for key, value in summary_figures(summary).items():
            self.writer.add_scalar(f"summary/{key}", value, global_step=step)
        self.writer.add_text(
            "summary",
            _code_block(to_json({k: v for k, v in summary.items() if k != "config"}, indent=2)),
            global_step=step,
        )
        self.writer.close()

    def abort(self, exit_code: int = 1) -> None:  # noqa: D102
        self.writer.close()


def _code_block(text: str) -> str:
    """``text`` as a Markdown code block (TensorBoard renders text summaries as Markdown)."""
    return "".join(f"    {line}\n" for line in text.splitlines())


class CSVLogger:
    """``metrics.csv`` (Lightning's ``CSVLogger``): one line per metrics row, the header the union of the rows'
    keys in the order they first appear. A row with a new key (the first evaluation's) rewrites the file with the
    wider header, atomically (a temporary file, then a rename); other rows are appended. Null is an empty cell.
    A run resumed from the checkpoint of ``resume_step`` keeps only the lines up to that step (as
    ``metrics.jsonl`` does)."""

    def __init__(self, path: Path, resume_step: int | None = None):
        self.path = path
        self.fields: list[str] = []
        if path.exists():
            fields, rows = self._read()
            if resume_step is not None:
                rows = [r for r in rows if _step(r) is not None and _step(r) <= resume_step]
            self.fields = fields
            self._rewrite(rows)

    def _read(self) -> tuple[list[str], list[dict[str, str]]]:
        with self.path.open(newline="") as f:
            reader = csv.DictReader(f)
            return list(reader.fieldnames or []), list(reader)

    def _rewrite(self, rows: list[dict[str, Any]]) -> None:
        tmp = self.path.with_suffix(".csv.tmp")
        try:
            with open_own(tmp, newline="") as f:
                writer = csv.DictWriter(f, self.fields, restval="")
                writer.writeheader()
                writer.writerows(rows)
            os.replace(tmp, self.path)
        finally:
            tmp.unlink(missing_ok=True)

    def log(self, row: dict[str, Any]) -> None:  # noqa: D102 - the class says it
        values = {k: "" if v is None else v for k, v in row.items()}
        new = [k for k in row if k not in self.fields]
        if new or not self.path.exists():
            rows = self._read()[1] if self.path.exists() else []
            self.fields += new
            self._rewrite([*rows, values])
            return
        with open_own(self.path, "a", newline="") as f:
            csv.DictWriter(f, self.fields, restval="").writerow(values)

    def finish(self, summary: dict[str, Any]) -> None:  # noqa: D102 - every line is written already
        pass

    def abort(self, exit_code: int = 1) -> None:  # noqa: D102
        pass


def _step(row: dict[str, str]) -> int | None:
    try:
        return int(float(row.get("step") or ""))
    except ValueError:
        return None


def local_mlflow_uri(job_dir: Path) -> str:
    """The local MLflow store of a job: SQLite in ``<job_dir>/mlruns/mlflow.db`` (MLflow 3 refuses its old file
    store unless ``MLFLOW_ALLOW_FILE_STORE=true``; SQLite is its own default, ``sqlite:///mlflow.db``)."""
    return f"sqlite:///{(job_dir / 'mlruns' / 'mlflow.db').resolve()}"


def mlflow_tracking_uri(configured: str | None, job_dir: Path) -> str:
    """Where the MLflow run goes: ``logger.mlflow.tracking_uri``, else ``$MLFLOW_TRACKING_URI``, else the job's
    local store (``local_mlflow_uri``). A tracking server (http/https) that does not accept a connection within
    3 s is replaced by the local store, with one line saying so."""
    uri = configured or os.environ.get("MLFLOW_TRACKING_URI") or ""
    local = local_mlflow_uri(job_dir)
    if not uri:
        return local
    if uri.startswith(("http://", "https://")) and not reachable(uri):
        print(f"MLflow: {uri} cannot be reached, logging to the local store {local} instead", flush=True)
        return local
    return uri


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """MLflow's setup without its chatter: the SQLite store's "Creating initial MLflow database tables" log
    records (MLflow's and Alembic's) and SQLAlchemy's deprecation warnings."""
    loggers = [logging.getLogger(name) for name in ("mlflow", "alembic")]
    levels = [lg.level for lg in loggers]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for lg in loggers:
                lg.setLevel(logging.WARNING)
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def flatten(config: dict, prefix: str = "") -> dict[str, Any]:
    """``{"trainer": {"max_steps": 6}}`` -> ``{"trainer.max_steps": 6}`` (lists stay values)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            flat |= flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


class MLflowLogger:
    """An MLflow run (``mlflow.tracking.MlflowClient``) in the experiment ``logger.project``: the flattened
    resolved config as params, every row's figures as metrics against the optimizer step, the summary's numbers
    as metrics (``samples_per_sec``, ...) and ``summary.json`` as an artifact at the end; the run then ends
    FINISHED, or FAILED/KILLED (a preemption or Ctrl-C) through ``abort``. ``run_id`` (from the checkpoint)
    continues that run, if the store holds it. The store: ``mlflow_tracking_uri``; what happens when it fails:
    docs/outputs-and-loggers.md, "MLflow"."""

    def __init__(self, cfg: DictConfig, job_dir: Path, resolved: dict, group: str | None, run_id: str | None = None):
        uri = mlflow_tracking_uri(cfg.mlflow.tracking_uri, job_dir)
        start = dict(
            job_dir=job_dir,
            project=cfg.project,
            tags=list(cfg.tags),
            group=group,
            run_id=run_id,
            params=flatten(resolved),
        )
        try:
            self._start(uri, **start)
        except Exception as e:  # noqa: BLE001 - MlflowException, requests' errors, ...: tracking never costs the run
            local = local_mlflow_uri(job_dir)
            if uri == local:
                raise
            print(f"MLflow: {uri} failed ({_first_line(e)}); logging to the local store {local} instead", flush=True)
            self._start(local, **start)
        self.step = 0

    def _start(
        self,
        uri: str,
        job_dir: Path,
        project: str,
        tags: list[str],
        group: str | None,
        run_id: str | None,
        params: dict[str, Any],
    ) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        with _quiet():
            self.client = client = MlflowClient(tracking_uri=uri)
            self.uri = uri
            local = uri == local_mlflow_uri(job_dir)
            experiment = client.get_experiment_by_name(project)
            if experiment is not None:
                experiment_id = experiment.experiment_id
            else:
                try:  # a local store keeps its artifacts beside it; a server decides itself
                    artifacts = (job_dir / "mlruns" / "artifacts").resolve().as_uri() if local else None
                    experiment_id = client.create_experiment(project, artifact_location=artifacts)
                except Exception:  # another job of the sweep created it meanwhile
                    experiment_id = client.get_experiment_by_name(project).experiment_id
        run = self._existing(run_id)
        if run is None:
            run_tags = {tag: "" for tag in tags} | ({"sweep": group} if group else {})
            run = client.create_run(experiment_id, run_name=f"{group}/{job_dir.name}" if group else None, tags=run_tags)
            if run_id is not None:
                print(
                    f"MLflow: the checkpoint's run {run_id} is not in {uri}; logging to a new run {run.info.run_id}",
                    flush=True,
                )
        else:
            client.update_run(run.info.run_id, status="RUNNING")
        self.run_id = run.info.run_id
        logged = run.data.params  # a resumed run: MLflow refuses to change a param, so only new ones are added
        items = [Param(k, str(v)[:6000]) for k, v in params.items() if k not in logged]
        for i in range(0, len(items), 100):  # log_batch takes at most 100 params per call
            client.log_batch(self.run_id, params=items[i : i + 100])

    def _existing(self, run_id: str | None):
        """The run ``run_id`` if this store holds it, else None."""
        if run_id is None:
            return None
        try:
            return self.client.get_run(run_id)
        except Exception:  # noqa: BLE001 - MlflowException RESOURCE_DOES_NOT_EXIST (or a malformed id)
            return None

    def _call(self, what: str, fn, *args) -> None:
        """``fn(*args)`` unless an earlier call failed; if it fails, one line and no more MLflow calls."""
        if self.client is None:
            return
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - tracking never costs the run
            print(f"MLflow: {what} failed ({_first_line(e)}); no more MLflow logging in this run", flush=True)
            self.client = None

    def log(self, row: dict[str, Any]) -> None:  # noqa: D102 - the class says it
        from mlflow.entities import Metric

        self.step = row["step"]
        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, row["step"]) for k, v in panel_figures(row).items()]
        if metrics:
            self._call("logging", lambda: self.client.log_batch(self.run_id, metrics=metrics))

    def finish(self, summary: dict[str, Any]) -> None:  # noqa: D102
        from mlflow.entities import Metric

        step, now = summary.get("steps") or self.step, int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in summary_figures(summary).items()]
        for i in range(0, len(metrics), 1000):  # log_batch takes at most 1000 metrics per call
            self._call(
                "logging the summary",
                lambda batch: self.client.log_batch(self.run_id, metrics=batch),
                metrics[i : i + 1000],
            )
        self._call(
            "storing summary.json",
            lambda: self.client.log_dict(self.run_id, json.loads(to_json(summary)), "summary.json"),
        )
        self._call("ending the run", lambda: self.client.set_terminated(self.run_id, "FINISHED"))

    def abort(self, exit_code: int = 1) -> None:  # noqa: D102
        status = "KILLED" if exit_code in (EXIT_PREEMPTED, 130) else "FAILED"
        self._call("ending the run", lambda: self.client.set_terminated(self.run_id, status))


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__
