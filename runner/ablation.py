"""The ablation's job plumbing: one fresh process per job, CUDA-only variants, repeats until the
intervals are tight, the machine and command.

``python -m runner -m +experiment=ablation model=... data=...`` is an ordinary Hydra multirun over
``ablation.repeat`` x ``ablation/variant`` (conf/experiment/ablation.yaml, conf/ablation/variant/).
What makes its figures comparable and trustworthy lives here:

- ``run_job``: Hydra's basic launcher runs every job in one Python process. Peak RSS (the CPU's peak
  memory figure) only ever grows in a process, ``torch.compile`` caches and recompile limits carry over,
  and global flags (``cudnn.benchmark``, TF32) stay set. So, inside a multirun, each job trains in a
  fresh process of its own. With ``ablation.preload=true`` (default) that process is forked from a
  *job server* (``multiprocessing``'s forkserver) that has imported torch, torchvision, Hydra and
  runner once and done nothing else: no torch op has run in it (no thread pool, no compile cache, no
  flag set) and no CUDA context exists, so each child starts as clean as ``python -m runner`` would,
  without paying the ~4-5 s of interpreter start and imports per job (the fixed cost the report shows
  as ``setup_s``). One difference: a forked child's peak RSS does not count the library pages the
  server loaded until the child touches them, so a CPU job's peak memory reads a few hundred MiB lower
  than in a standalone run (the same for every configuration of the sweep). ``ablation.preload=false``
  starts ``python -m runner <the job's overrides> hydra.run.dir=<its folder> ablation.isolate=false``
  instead, exactly the process a user would start. Either way the parent times the child and writes
  ``<job>/job.json`` (start, end, exit status), from which the report derives each job's setup time.
- ``ablation.requires=cuda``: a variant that can only differ from its reference on CUDA (the cuDNN
  autotuner; the leave-one-out of the CUDA-only bigger batch) is not run elsewhere; ``not_run.json`` in
  its folder says why, and the report lists it.
- A variant whose technique the task skips (an image technique on a language model, ``_no_op_reason``) is
  its reference's configuration again: it is not run either, and its ``not_run.json`` says so.
- ``ablation.repeats=auto``: Hydra's sweeper enumerates its jobs up front, so a sweep cannot decide to
  run more of them. Instead the first multirun runs min(3, ``ablation.max_repeats``) repeats, and
  ``AblationCallback.on_multirun_end`` (``auto_repeat``) then launches further rounds, each an ordinary
  multirun into the same sweep folder (``ablation.repeat=<n> ablation/variant=<the configurations still
  too uncertain, with their references>``), until every effect's simultaneous 95 % interval is within
  ±``ablation.target_ci`` or ``ablation.max_repeats`` repeats have run. Each round's command, its
  configurations and the reason the rounds stopped go into ``ablation.json`` and the report.
- ``AblationCallback``: at the start of the sweep, ``ablation.json`` records the machine (CPU model,
  cores, memory, GPUs, native bf16, load average) and the exact command, and the job server is started
  (its start-up time is recorded); at the end it adds rounds (``repeats=auto``) and writes the report
  (runner/report/).
"""

from __future__ import annotations

import copy
import json
import multiprocessing
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from runner import ablation_first_round, hardware
from runner.errors import ConfigError
from runner.report import ReportError, build_rows, load_jobs, pending, sweep_command, write_report
from runner.track import write_json_atomic

#: What a job that did not train returns to Hydra (``__main__`` reads ``samples_per_sec``).
_NO_FIGURES = {"samples_per_sec": None}
#: The configuration keys an ablation technique (``ablation.technique``) switches, for the ones a task may skip
#: (``Task.skipped``): on a language model these image techniques leave the job as its reference was
TECHNIQUE_KEYS = {"channels_last": ("channels_last",), "cudnn_benchmark": ("cudnn_benchmark",),
                  "drop_bias": ("model.drop_bias_before_bn",), "normalize": ("data.normalize",)}
#: What the job server imports once, before it forks any job (importing them runs no torch op and starts
#: no thread). torch._dynamo is imported lazily by the FLOP count of every job: ~2.5 s each on 2 cores.
SERVER_PRELOAD = ["torch._dynamo", "runner.train", "runner.ablation"]


def run_job(cfg: DictConfig, job_dir: Path | None = None) -> dict[str, Any] | None:
    """Handle an ablation job before anything is built; None means "train it here, in this process".

    - A variant with ``ablation.requires=cuda`` on a job that will not use CUDA, or one that does nothing on
      this job (``_no_op_reason``): writes ``<job_dir>/not_run.json`` (variant, repeat, reason) and returns
      ``{"samples_per_sec": None}``.
    - Inside a Hydra multirun with ``ablation.isolate=true``: trains the job in a fresh process (see the
      module docstring), writes ``<job_dir>/job.json`` (its start and end, ``time.time()`` s, and exit
      status) and returns the child's ``summary.json``; when the child fails, writes
      ``<job_dir>/failed.json`` (exit status) and returns ``{"samples_per_sec": None}``, so one broken
      configuration does not stop a 30-minute sweep (the report lists it).
    - Otherwise (a single run, tests, the child itself): None.

    Raises:
        ConfigError: ``ablation.requires`` is not null or ``cuda``.
    """
    a = cfg.ablation
    if a.variant is None:
        return None
    if a.requires not in (None, "cuda"):
        raise ConfigError(f"ablation.requires={a.requires!r} must be null or 'cuda'")
    hydra_cfg = _hydra_config()
    folder = job_dir or (Path(hydra_cfg.runtime.output_dir) if hydra_cfg is not None else None)
    reason = (f"needs CUDA; this job runs on trainer.device={cfg.trainer.device} without CUDA"
              if a.requires == "cuda" and not hardware.uses_cuda(str(cfg.trainer.device)) else _no_op_reason(cfg))
    if reason is not None:  # recorded, not run: the report lists it with its reason
        if folder is None:
            raise ConfigError(f"ablation variant {a.variant} is not run here ({reason}) and no job folder is known "
                              f"to record that")
        write_json_atomic(folder / "not_run.json", {"variant": a.variant, "repeat": a.repeat, "reason": reason})
        print(f"ablation: {a.variant} r{a.repeat} not run: {reason}", flush=True)
        return dict(_NO_FIGURES)
    if not a.isolate or hydra_cfg is None or job_dir is not None or not _is_multirun(hydra_cfg):
        return None
    return _run_in_child(cfg, folder, list(hydra_cfg.overrides.task), Path(hydra_cfg.sweep.dir).name,
                         f"{a.variant}/r{a.repeat}")


def _no_op_reason(cfg: DictConfig) -> str | None:
    """Why this leave-one-in or leave-one-out variant is its reference's configuration on this job, or None.

    A technique the task skips (``Task.skipped``: channels_last or input normalization on a language model,
    whose inputs are token ids) changes nothing, so measuring it would only spend the sweep's minutes on a
    second copy of the reference. It is a no-op when switching each of its keys (``TECHNIQUE_KEYS``) on adds
    a skipped technique to the task's list."""
    from runner import task as task_mod

    a = cfg.ablation
    keys = TECHNIQUE_KEYS.get(a.get("technique"))
    if not keys or a.get("kind") not in ("leave-one-in", "leave-one-out") or "task" not in cfg:
        return None
    task = task_mod.build(cfg.task)
    reasons = []
    for key in keys:
        on, off = copy.deepcopy(cfg), copy.deepcopy(cfg)
        OmegaConf.update(on, key, True, force_add=True)
        OmegaConf.update(off, key, False, force_add=True)
        added = [r for status, r in task.skipped(on).items() if status not in task.skipped(off)]
        if not added:
            return None
        reasons += added
    what = "; ".join(r.removeprefix("skipped: ") for r in reasons)
    return f"does nothing on this job ({what}): the same configuration as its reference"


def _hydra_config():
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get() if HydraConfig.initialized() else None


def _is_multirun(hydra_cfg) -> bool:
    from hydra.types import RunMode

    return hydra_cfg.mode == RunMode.MULTIRUN


def _quote(value: str) -> str:
    """``value`` as a single-quoted Hydra override value (paths may hold ``+``, ``=``, ``,``)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


# ------------------------------------------------------------------------------------------- the job server
#: The longest path a Unix socket may have on Linux (``sun_path`` holds 108 bytes with the final NUL)
_UNIX_SOCKET_PATH_MAX = 107


def check_socket_dir() -> None:
    """Raise ConfigError when the forkserver's socket would not fit in a Unix socket path.

    The server listens on ``<temp dir>/pymp-XXXXXXXX/listener-XXXXXXXX`` (``multiprocessing.util.get_temp_dir``
    under ``TMPDIR``); a longer path fails deep inside ``multiprocessing`` with "AF_UNIX path too long".
    """
    from multiprocessing import util

    socket = os.path.join(util.get_temp_dir(), "listener-XXXXXXXX")
    if len(os.fsencode(socket)) > _UNIX_SOCKET_PATH_MAX:
        raise ConfigError(
            f"the job server's socket would be {socket!r} ({len(os.fsencode(socket))} bytes), longer than the "
            f"{_UNIX_SOCKET_PATH_MAX} bytes a Unix socket path may hold: set TMPDIR to a shorter folder (e.g. "
            f"TMPDIR=/tmp)")


def _job_server() -> Any:
    """multiprocessing's forkserver context, preloading ``SERVER_PRELOAD``; ConfigError when ``TMPDIR`` is too
    long for its socket."""
    check_socket_dir()
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(SERVER_PRELOAD)  # only read when the server starts
    return ctx


def _ready() -> None:
    """A child that does nothing: forking it waits until the server has imported ``SERVER_PRELOAD``."""


def start_job_server() -> float:
    """Start the job server (a no-op when it runs) and wait until it can fork; returns the seconds taken.

    The server is ``multiprocessing``'s forkserver of this process: a fresh interpreter that imports
    ``SERVER_PRELOAD`` and then only forks children on request; it exits with this process.
    """
    started = time.perf_counter()
    child = _job_server().Process(target=_ready, name="ablation job server check")
    child.start()
    child.join()
    return time.perf_counter() - started


def _train_forked(cfg: DictConfig, job_dir: str, env: dict[str, str], start_method: str | None = None) -> None:
    """The body of a forked job: train ``cfg`` into ``job_dir``; bad input exits 2 like ``python -m runner``.

    ``start_method``: the parent's ``multiprocessing`` start method. A child of the forkserver would
    otherwise start its own processes (DataLoader workers) by forkserver too, unlike ``python -m runner``
    (fork on Linux before Python 3.14): slower worker start-up, and a dataset that does not pickle fails."""
    os.environ.update(env)
    if start_method:
        multiprocessing.set_start_method(start_method, force=True)
    from runner.train import train

    try:
        train(cfg, Path(job_dir))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


def fork_train(cfg: DictConfig, job_dir: Path, env: dict[str, str], name: str) -> int:
    """Train ``cfg`` (resolved, ``ablation.isolate=false``) into ``job_dir`` in a child forked from the job
    server (started on first use), with ``env`` added to its environment; wait for it and return its exit
    status (0: ``summary.json`` written; 2: bad input). The child's working directory and ``sys.path`` are
    this process's at the call (``multiprocessing`` hands them over), so a module in the run folder imports."""
    child = _job_server().Process(target=_train_forked, args=(cfg, str(job_dir), env, multiprocessing.get_start_method()),
                                  name=name)
    child.start()
    child.join()
    return child.exitcode


def _run_in_child(cfg: DictConfig, job_dir: Path, overrides: list[str], group: str, name: str) -> dict[str, Any]:
    a = cfg.ablation
    cmd = [sys.executable, "-m", "runner", *overrides, f"hydra.run.dir={_quote(str(job_dir))}",
           "ablation.isolate=false"]
    # The child is not a Hydra multirun job, so track.sweep_group() is None there: W&B reads the group from the env.
    env = {"WANDB_RUN_GROUP": group, "WANDB_NAME": f"{group}/{name}"}
    started = time.time()
    if a.preload:
        job_cfg = copy.deepcopy(cfg)
        OmegaConf.resolve(job_cfg)  # ${hydra:...} and ${now:...} mean what they mean in this job, not in the child
        job_cfg.ablation.isolate = False
        returncode = fork_train(job_cfg, job_dir, env, name)
    else:
        returncode = subprocess.run(cmd, env={**os.environ, **env}).returncode
    finished = time.time()
    write_json_atomic(job_dir / "job.json", {
        "variant": a.variant, "repeat": a.repeat, "process": "forkserver" if a.preload else "exec",
        "started": started, "finished": finished, "wall_s": finished - started, "returncode": returncode})
    summary_path = job_dir / "summary.json"
    if returncode == 0 and summary_path.is_file():
        summary = json.loads(summary_path.read_text())
        print(f"ablation: {name} done in {finished - started:.1f} s{job_figures(summary)}", flush=True)
        return summary
    write_json_atomic(job_dir / "failed.json", {"variant": a.variant, "repeat": a.repeat, "returncode": returncode,
                                                 "command": shlex.join(cmd)})
    print(f"ablation: {name} FAILED (exit status {returncode}); its output is above and in {job_dir}; "
          f"the sweep goes on", file=sys.stderr, flush=True)
    return dict(_NO_FIGURES)


def job_figures(summary: dict[str, Any]) -> str:
    """A finished job's figures for its one console line (the jobs run with ``trainer.progress=off``):
    ``": 132.1 samples/s, eval_loss 1.57"``, and ``"; busy machine: <why>"`` when its summary.json has
    machine-load ``warnings``; ``""`` without a figure."""
    sps, loss = summary.get("samples_per_sec"), summary.get("eval_loss")
    parts = [f"{sps:,.1f} samples/s" if isinstance(sps, (int, float)) else "no speed figure"]
    if isinstance(loss, (int, float)):
        parts.append(f"eval_loss {loss:.4g}")
    warnings = summary.get("warnings") or []
    busy = f"; busy machine: {warnings[0]}" if warnings else ""
    return f": {', '.join(parts)}{busy}"


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def round_command(hydra_cfg: DictConfig, sweep: Path, repeat: int, variants: list[str]) -> list[str]:
    """The command of one further round of ``ablation.repeats=auto``: the sweep's own overrides, with
    ``ablation.repeat=<repeat>`` (one repeat), ``ablation/variant=<variants>`` and the same sweep folder.

    ``ablation.repeats=<repeat + 1>`` (a number) makes the round an ordinary multirun that adds no
    rounds of its own.
    """
    drop = {"ablation.repeats", "ablation.repeat", "ablation/variant", "hydra.sweep.dir", "hydra.mode"}
    keep = [str(o) for o in (*hydra_cfg.overrides.hydra, *hydra_cfg.overrides.task) if _key(str(o)) not in drop]
    return [sys.executable, "-m", "runner", "-m", *keep, f"ablation.repeats={repeat + 1}", f"ablation.repeat={repeat}",
            "ablation/variant=" + ",".join(variants), f"hydra.sweep.dir={_quote(str(sweep.resolve()))}"]


def auto_repeat(sweep: Path, target_ci: float, max_repeats: int, done: int,
                launch: Callable[[int, list[str]], int]) -> tuple[str, list[dict[str, Any]]]:
    """Add rounds of repeats to the sweep in ``sweep`` until its intervals are tight enough.

    After each round the report's rows are rebuilt (runner/report/rows.py); the configurations whose effect
    interval is missing or wider than ±``target_ci`` (relative half-width; ``report.pending``) run once
    more, together with their references (the baseline always; the fast preset when a leave-one-out
    row or the preset itself is pending), as repeat number ``done``, through ``launch(repeat,
    variants)``, which returns an exit status. Stops when nothing is pending, when ``done`` reaches
    ``max_repeats``, or when a round fails (non-zero status).

    Returns:
        Why it stopped (one line), and one record per round: repeat, configurations, the widest pending
        half-width before it, wall time (s) and exit status.

    Raises:
        runner.report.ReportError: the sweep cannot be read (e.g. the baseline never measured).
    """
    rounds: list[dict[str, Any]] = []
    while True:
        rows = build_rows(load_jobs(sweep))
        by = {r.configuration: r for r in rows}
        waiting = pending(rows, target_ci)
        if not waiting:
            return f"every effect's simultaneous 95 % interval within ±{target_ci:.1%} after {done} repeat(s)", rounds
        widths = {v: by[v].effect_ci.half_width if by[v].effect_ci else None for v in waiting}
        widest = ", ".join(f"{v} ({'no interval' if w is None else f'±{w:.1%}'})" for v, w in widths.items())
        if done >= max_repeats:
            return f"ablation.max_repeats={max_repeats} reached; still wider than ±{target_ci:.1%}: {widest}", rounds
        refs = {"baseline"} | ({"fast"} if "fast" in by and any(
            v == "fast" or by[v].kind == "leave-one-out" for v in waiting) else set())
        variants = sorted(set(waiting) | refs, key=lambda v: [r.configuration for r in rows].index(v))
        print(f"ablation: repeats=auto: round {done} for {len(variants)} configuration(s); still too wide: {widest}",
              flush=True)
        started = time.time()
        status = launch(done, variants)
        rounds.append({"repeat": done, "variants": variants, "pending": {v: w for v, w in widths.items()},
                       "wall_s": time.time() - started, "returncode": status})
        if status != 0:
            return f"the round of repeat {done} failed (exit status {status}); see its output above", rounds
        done += 1


class AblationCallback(Callback):
    """Hydra callback of ``+experiment=ablation`` (``hydra.callbacks.ablation_report``).

    ``on_multirun_start`` writes ``<sweep>/ablation.json`` (machine, command, start time, how jobs are
    started) and starts the job server; a multirun into a sweep folder that already has an
    ``ablation.json`` is a further round of that sweep and is only appended to its ``multiruns`` list.
    ``on_multirun_end`` adds the end time and load average, adds rounds while ``ablation.repeats=auto``
    asks for them (``auto_repeat``) and writes the report; a round launched by ``auto_repeat`` leaves
    the report to the sweep that launched it (and under torchrun, ranks > 0 leave it to rank 0). A report that cannot be made (no summaries, no baseline)
    prints one ``error:`` line and exits with status 1. Bad ``ablation.repeats`` (neither a number nor
    ``auto``), ``ablation.max_repeats`` or ``ablation.target_ci`` print one ``error:`` line and exit with
    status 2 before any job runs (Hydra turns exceptions from callbacks into warnings).
    """

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        a = config.ablation
        try:
            ablation_first_round(a.repeats, a.max_repeats, a.design)
            if a.repeats == "auto" and not a.target_ci > 0:
                raise ValueError(f"ablation.target_ci={a.target_ci}: give the relative half-width to reach, e.g. 0.05")
            if a.isolate and a.preload:
                check_socket_dir()  # a ConfigError (a ValueError) here, not a traceback from the first job
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(2)
        sweep = Path(config.hydra.sweep.dir)
        sweep.mkdir(parents=True, exist_ok=True)
        path = sweep / "ablation.json"
        entry: dict[str, Any] = {"command": sweep_command(config.hydra), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                                 "started_s": time.time()}
        if a.isolate and a.preload:
            entry["job_server_start_s"] = round(start_job_server(), 2)
        if path.is_file():  # a further round into this sweep
            record = json.loads(path.read_text())
            record.setdefault("multiruns", []).append(entry | {"load_average_1min": hardware.load_average()})
        else:
            record = entry | {"machine": hardware.describe_machine(), "job_process": (
                "forkserver" if a.preload else "exec") if a.isolate else "in-process"}
        write_json_atomic(path, record)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from runner.launch import discover

        if discover().rank != 0:  # under torchrun, ranks > 0 swept in a scratch folder: rank 0 reports
            return
        a = config.ablation
        sweep = Path(config.hydra.sweep.dir)
        path = sweep / "ablation.json"
        record = json.loads(path.read_text()) if path.is_file() else {}
        if record.get("auto") is not None and record["auto"].get("stopped") is None:
            return  # a round of repeats=auto: the sweep that launched it goes on and writes the report
        try:
            if a.repeats == "auto" and a.design == "rounds":
                first = ablation_first_round(a.repeats, a.max_repeats)
                record["auto"] = {"target_ci": a.target_ci, "max_repeats": a.max_repeats, "first_round": first,
                                  "rounds": [], "stopped": None}
                write_json_atomic(path, record)

                def launch(repeat: int, variants: list[str]) -> int:
                    cmd = round_command(config.hydra, sweep, repeat, variants)
                    print("ablation: " + shlex.join(cmd), flush=True)
                    return subprocess.run(cmd).returncode

                stopped, rounds = auto_repeat(sweep, a.target_ci, a.max_repeats, first, launch)
                record = json.loads(path.read_text())
                record["auto"] |= {"rounds": rounds, "stopped": stopped}
                print(f"ablation: repeats=auto stopped: {stopped}", flush=True)
            record["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
            record["finished_s"] = time.time()
            record["load_average_1min_at_end"] = hardware.load_average()
            write_json_atomic(path, record)
            written = write_report(sweep)
        except ReportError as e:
            if record.get("auto") is not None and record["auto"].get("stopped") is None:
                record["auto"]["stopped"] = f"error: {e}"
                write_json_atomic(path, record)
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(1)
        print("ablation report: " + ", ".join(str(p) for p in written), flush=True)
