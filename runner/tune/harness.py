"""What every tuner shares: the ``tune.*`` checks, one trial of a configuration with the engine's own
``build``/``fit``, out-of-memory handling, the figures reduced and the picks gathered over the ranks, the
outputs (csv, markdown, png, json) and ``run``, which drives one ``Tuner``.

A tuner (runner/tune/batch_size.py, lr.py, dataloader.py) is a ``Tuner``: its search, its table's columns,
its pick rule and its plot. The harness knows no tuner by name; the registry is runner/tune/__init__.py.
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import gc
import math
import tempfile
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf

from runner.config import global_batch_size
from runner.config.logger import LOGGERS
from runner.errors import ConfigError
from runner.files import open_own, write_own

GUARD_MIN_STEPS = 5  # tune.guard_steps: at least one step per window of the speed tuner's guard
NO_PROFILER = types.SimpleNamespace(step=lambda: None)  # fit() steps a profiler; tuning runs none

#: ``(key, header, format)`` of one column of a tuner's printed and markdown tables (format: ``format()``'s
#: spec for floats, "" to print the value as it is)
Column = tuple[str, str, str]


@dataclass(frozen=True)
class Tuner:
    """One tuner, everything the harness and the CLI need to know of it.

    Attributes:
        name: the CLI's name (``python -m runner.tune <name>``) and the outputs' stem (``<name>.csv``, ...).
        help: what it does, for ``--help`` (lines after the first are indented under it).
        tune: ``tune(cfg, env, job_dir) -> result``: the search on the composed run config; ``job_dir`` is a
            scratch folder for the trials. The result holds ``recommended`` (a dict, identical on every
            rank), ``override`` (the command-line override to use), ``rows`` (the measurements) and
            ``notes`` (lines for the report); anything else goes into ``<name>.json``.
        columns: the table's columns; a column no row has a value for is left out.
        is_pick: ``is_pick(row, recommended)``: the row the table marks as recommended.
        plot: ``plot(result) -> matplotlib Figure`` (draw with ``pyplot()``); the harness saves and closes it.
        console_rows: the console shows about this many of the rows (every k-th and the pick), the markdown file
            twice as many (the CSV all); None: every row in both (each row a decision, as the speed tuner's).
    """

    name: str
    help: str
    tune: Callable[[DictConfig, Any, Path], dict[str, Any]]
    columns: list[Column]
    is_pick: Callable[[dict, dict], bool]
    plot: Callable[[dict[str, Any]], Any]
    console_rows: int | None = 15


# ------------------------------------------------------------------------------------------- settings


def check_settings(t: DictConfig) -> None:
    """Value checks of ``tune.*`` (types are the schema's, checked by Hydra at compose time).

    Raises:
        ConfigError: naming the key, its value and the allowed range.
    """

    def positive_list(values, minimum: int) -> bool:
        return values is None or (len(values) > 0 and all(v >= minimum for v in values))

    checks = [
        (t.warmup_steps >= 0, "tune.warmup_steps", t.warmup_steps, "must be >= 0"),
        (t.measure_steps >= 1, "tune.measure_steps", t.measure_steps, "must be >= 1"),
        (t.start_batch_size >= 1, "tune.start_batch_size", t.start_batch_size, "must be >= 1"),
        (
            t.max_batch_size >= t.start_batch_size,
            "tune.max_batch_size",
            t.max_batch_size,
            f"must be >= tune.start_batch_size={t.start_batch_size}",
        ),
        (0 < t.max_memory_fraction <= 1, "tune.max_memory_fraction", t.max_memory_fraction, "must be in (0, 1]"),
        (t.search_steps >= 0, "tune.search_steps", t.search_steps, "must be >= 0"),
        (t.min_lr > 0, "tune.min_lr", t.min_lr, "must be > 0 (the ramp is exponential)"),
        (t.max_lr > t.min_lr, "tune.max_lr", t.max_lr, f"must be > tune.min_lr={t.min_lr}"),
        (
            t.steps >= 10,
            "tune.steps",
            t.steps,
            "must be >= 10 (the suggestions leave out the first 10 % and the last 5 steps)",
        ),
        (0 <= t.smoothing < 1, "tune.smoothing", t.smoothing, "must be in [0, 1)"),
        (t.diverge_factor > 1, "tune.diverge_factor", t.diverge_factor, "must be > 1"),
        (positive_list(t.workers, 0), "tune.workers", t.workers, "must be a non-empty list of counts >= 0, or null"),
        (
            t.pin_memory is None or len(t.pin_memory) > 0,
            "tune.pin_memory",
            t.pin_memory,
            "must be a non-empty list of booleans, or null",
        ),
        (
            positive_list(t.prefetch_factors, 1),
            "tune.prefetch_factors",
            t.prefetch_factors,
            "must be a non-empty list of numbers >= 1, or null",
        ),
        (t.loader_batches >= 1, "tune.loader_batches", t.loader_batches, "must be >= 1"),
        (0 <= t.tolerance < 1, "tune.tolerance", t.tolerance, "must be in [0, 1)"),
        (t.budget_minutes > 0, "tune.budget_minutes", t.budget_minutes, "must be > 0"),
        (t.allow in ("speed", "recipe"), "tune.allow", t.allow, "must be speed or recipe"),
        (t.objective in ("job", "throughput"), "tune.objective", t.objective, "must be job or throughput"),
        (t.processes is None or t.processes >= 1, "tune.processes", t.processes, "must be >= 1, or null"),
        (
            t.guard_steps >= GUARD_MIN_STEPS,
            "tune.guard_steps",
            t.guard_steps,
            f"must be >= {GUARD_MIN_STEPS} (the guard compares the loss curves over 5 windows)",
        ),
        (t.guard_tolerance > 0, "tune.guard_tolerance", t.guard_tolerance, "must be > 0 (relative, e.g. 0.02)"),
        (t.min_speedup >= 1, "tune.min_speedup", t.min_speedup, "must be >= 1 (a switch must not be slower)"),
        (0 < t.target_ci < 1, "tune.target_ci", t.target_ci, "must be in (0, 1), e.g. 0.05"),
        (t.slice_seconds > 0, "tune.slice_seconds", t.slice_seconds, "must be > 0"),
    ]
    for ok, key, value, rule in checks:
        if not ok:
            shown = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
            raise ConfigError(f"{key}={shown} {rule}")


def with_overrides(cfg: DictConfig, **changes: Any) -> DictConfig:
    """A copy of ``cfg`` quiet for tuning (no W&B, no console rows, never resumes) with ``changes`` applied
    (dotted keys written with ``__``: ``dataloader__batch_size=64``); ``cfg`` itself is left as it was."""
    out = copy.deepcopy(cfg)
    settings = {**{f"logger.{name}": None for name in LOGGERS}, "trainer.progress": "off", "checkpoint.resume": "never"}
    settings |= {k.replace("__", "."): v for k, v in changes.items()}
    for key, value in settings.items():
        OmegaConf.update(out, key, value, merge=False)
    return out


# ------------------------------------------------------------------------------------------- out of memory


def is_oom(e: BaseException) -> bool:
    """True for a CUDA out-of-memory error (``torch.cuda.OutOfMemoryError``) or the CPU allocator's failure
    (a ``RuntimeError`` saying "out of memory" or "can't allocate memory")."""
    import torch

    if isinstance(e, torch.cuda.OutOfMemoryError):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def free_memory(device) -> None:
    """Return the previous configuration's memory: collect garbage, empty CUDA's cache, and on glibc hand
    free heap pages back to the OS (``malloc_trim``), so the next CPU peak starts from what is really held."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# ------------------------------------------------------------------------------------------- the ranks


def reduce_max(values: list[float], env) -> list[float]:
    """Element-wise maximum over the ranks (the values themselves with one process)."""
    if not env.distributed:
        return values
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def gather(value: Any, env) -> list[Any]:
    """Every rank's ``value``, in rank order (``[value]`` with one process)."""
    if not env.distributed:
        return [value]
    import torch.distributed as dist

    box: list[Any] = [None] * env.world_size
    dist.all_gather_object(box, value)
    return box


# ------------------------------------------------------------------------------------------- one trial


def for_tuning(parts, steps: int, warmup: int, log_every: int, **replace: Any):
    """The engine's ``parts`` set up to train ``steps`` optimizer steps (``warmup`` of them left out of the
    figures) with the run's own loop: a copy with the plan shortened (evaluation: one batch, after the last
    step; no targets), a fresh meter, a checkpointer that never saves and ``replace['tracker']`` (default:
    ``NullTracker``) as the tracker; ``parts`` itself is left as it was."""
    from runner import checkpoint, measure
    from runner.track import NullTracker

    plan = dataclasses.replace(
        parts.plan,
        total_steps=steps,
        log_every=log_every,
        eval_every=steps,
        eval_max_batches=1,
        target_accuracy=None,
        target_loss=None,
    )
    meter = measure.Meter(parts.env.device, warmup, plan.global_batch, parts.task.tokens_per_sample(parts.data))
    fields = dict(
        plan=plan,
        meter=meter,
        tracker=NullTracker(),
        at_end=False,
        checkpointer=checkpoint.Checkpointer(parts.job_dir / checkpoint.FOLDER, is_main=parts.env.is_main),
    )
    return dataclasses.replace(parts, **(fields | replace))


def loader_seconds(parts, warmup: int, batches: int) -> float:
    """Seconds to draw ``batches`` batches from the run's training loader alone (host->device copy included,
    epochs cycled as in training), after ``warmup`` batches (workers starting) left out."""
    from runner import measure
    from runner.engine import train as engine
    from runner.engine.state import TrainState

    it = engine.batches(parts.data.train, TrainState())
    for _ in range(warmup):
        next(it)
    start = measure.wall_clock(parts.env.device)
    for _ in range(batches):
        next(it)
    elapsed = measure.wall_clock(parts.env.device) - start
    it.close()  # drops the loader's iterator: its workers stop (unless persistent)
    return elapsed


def measure_config(cfg: DictConfig, env, job_dir: Path, t: DictConfig, loader_batches: int = 0) -> dict[str, Any]:
    """Build ``cfg``'s job with the engine and train ``t.warmup_steps + t.measure_steps`` steps of it.

    Returns a row: ``status`` (``ok``, ``oom``: CUDA's ``OutOfMemoryError`` or the CPU allocator's failure,
    caught and the memory returned; ``unmeasured``), ``samples_per_sec`` (global: global batch x measured
    steps / the slowest rank's measured time), ``tokens_per_sec`` (token tasks), ``step_time_ms_median``
    and ``data_wait_fraction`` (the engine's meter, slowest rank), ``peak_memory_mb`` (MiB, largest over
    ranks: ``runner.measure.peak_memory_mb`` from after the build to the end of the steps, so it covers
    model, optimizer state, activations and the loader's batches; DataLoader worker processes are not
    counted), ``train_samples`` (per rank), ``load_warnings`` (``runner.measure.machine_load.load_warnings`` over the
    measured steps, joined with "; ": why this trial's figures cannot be trusted; empty when none). With
    ``loader_batches``, also ``loader_batches_per_sec``: the training loader alone (``loader_seconds``), slowest rank.

    Raises:
        Whatever building or training raises except an out-of-memory error (``ConfigError`` for a bad
        config). Under several processes an out-of-memory error on one rank only, inside a collective,
        cannot be recovered: the others wait until ``distributed.timeout_s``.
    """
    import torch

    from runner import measure
    from runner.engine import build as builder, train as engine
    from runner.errors import TrainingDiverged
    from runner.measure import machine_load

    if cfg.compile.mode is not None:
        torch._dynamo.reset()  # each configuration compiles afresh (and no recompile limit is reached)
    row: dict[str, Any] = {"note": ""}
    parts = state = None
    oom, figures, peak, loader_s, train_samples, tokens = False, None, 0.0, 0.0, 0, None
    steps = t.warmup_steps + t.measure_steps
    try:
        parts, state = builder.build_parts(cfg, env, Path(tempfile.mkdtemp(prefix="trial-", dir=job_dir)))
        parts = for_tuning(parts, steps, t.warmup_steps, log_every=steps)
        train_samples = parts.data.train_samples // env.world_size
        tokens = parts.task.tokens_per_sample(parts.data)
        if loader_batches:
            loader_s = loader_seconds(parts, t.warmup_steps, loader_batches)
        if not measure.reset_peak_memory(env.device):
            row["note"] = "peak RSS since the process started (could not reset it)"
        try:
            engine.fit(state, parts, NO_PROFILER)
        except TrainingDiverged:
            row["note"] = "loss not finite (speed still measured)"
        parts.meter.flush()
        figures = parts.meter.totals()
        peak = measure.peak_memory_mb(env.device)
        workers = cfg.dataloader.num_workers if parts.data.techniques.get("num_workers") == "applied" else 0
        load = parts.meter.machine_load(torch.get_num_threads(), workers)  # over the measured steps, as a run's
        row["load_warnings"] = "; ".join(machine_load.load_warnings(load, env.device.type))
    except Exception as e:  # noqa: BLE001 - out of memory is a measurement here; anything else is re-raised
        if not is_oom(e):
            raise
        oom = True
    finally:
        parts = state = None
        free_memory(env.device)
    ok = not oom and figures is not None and figures["measured_steps"] > 0
    # one all-reduce: the worst status (2 out of memory, 1 unmeasured), the slowest time, the largest peak;
    # measured steps negated (max -> the fewest)
    keys = ("measured_time_s", "step_time_ms_median", "data_wait_fraction")
    vals = [
        2.0 if oom else float(not ok),
        *(figures[k] if ok else 0.0 for k in keys),
        peak,
        loader_s,
        -(figures["measured_steps"] if ok else 0),
    ]
    failed, time_s, step_ms, wait, peak, loader_s, neg_steps = reduce_max(vals, env)
    global_batch = global_batch_size(cfg.dataloader.batch_size, cfg.memory.accumulate_steps, env.world_size)
    row.update(
        status={0: "ok", 1: "unmeasured", 2: "oom"}[int(failed)],
        samples_per_sec=None,
        tokens_per_sec=None,
        step_time_ms_median=None,
        data_wait_fraction=None,
        peak_memory_mb=peak or None,
        train_samples=train_samples,
    )
    if failed == 2:
        row["note"] = "out of memory" + ("" if oom else " on another rank")
    if not failed and time_s > 0:
        sps = global_batch * -neg_steps / time_s
        row.update(
            samples_per_sec=sps,
            tokens_per_sec=sps * tokens if tokens else None,
            step_time_ms_median=step_ms,
            data_wait_fraction=wait,
        )
    if loader_batches:
        row["loader_batches_per_sec"] = loader_batches / loader_s if not failed and loader_s > 0 else None
    return row


def load_note(rows: list[dict]) -> str | None:
    """The note for the trials measured on a busy machine (their ``load_warnings``), as a run's summary table
    warns; None when every trial measured on a quiet machine."""
    busy = [r for r in rows if r.get("load_warnings")]
    if not busy:
        return None
    measured = sum(1 for r in rows if r.get("samples_per_sec"))
    return (
        f"warning: {len(busy)} of {measured} measured trials ran on a busy machine (e.g. "
        f"{busy[0]['load_warnings']}): their figures are slower and noisier than on a quiet machine, and the "
        f"pick may differ there; rerun when it is quiet"
    )


def trial_steps(t: DictConfig) -> str:
    """How long each trial is, for the notes: ``"2 warm-up + 10 measured steps"``."""
    return f"{t.warmup_steps} warm-up + {t.measure_steps} measured step" + ("s" if t.measure_steps != 1 else "")


def say(env, message: str) -> None:
    """Print ``message`` on rank 0 (a tuner's progress line)."""
    if env.is_main:
        print(message, flush=True)


def fmt(value: Any, spec: str = ",.1f") -> str:
    """``value`` for a table cell: floats with ``spec``, "-" for None and non-finite floats."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


# ------------------------------------------------------------------------------------------- outputs


def markdown_table(tuner: Tuner, rows: list[dict], rec: dict, max_rows: int | None = None) -> str:
    """The rows as a markdown table of ``tuner.columns`` (those some row has a value for), the recommended
    row (``tuner.is_pick``) marked; ``max_rows``: every k-th row (and the recommended one) so at most about
    that many are shown."""
    cols = [c for c in tuner.columns if any(r.get(c[0]) not in (None, "") for r in rows)]
    shown = rows
    if max_rows and len(rows) > max_rows:
        k = math.ceil(len(rows) / max_rows)
        shown = [r for i, r in enumerate(rows) if i % k == 0 or i == len(rows) - 1 or tuner.is_pick(r, rec)]
    lines = ["| " + " | ".join(h for _, h, _ in cols) + " | |", "|" + "---|" * (len(cols) + 1)]
    for r in shown:
        cells = [fmt(r.get(k), spec) if spec else fmt(r.get(k)) for k, _, spec in cols]
        lines.append("| " + " | ".join(cells) + (" | **<- recommended** |" if tuner.is_pick(r, rec) else " | |"))
    return "\n".join(lines)


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (files only, no display needed): what a tuner's plot draws with."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(tuner: Tuner, result: dict, path: Path) -> None:
    """``tuner.plot``'s figure of ``result`` saved as ``path`` (png, 120 dpi)."""
    plt = pyplot()
    fig = tuner.plot(result)
    fig.tight_layout()
    with open_own(path, "wb") as f:
        fig.savefig(f, dpi=120, format="png")
    plt.close(fig)


def write_outputs(tuner: Tuner, result: dict, cfg: DictConfig, out: Path) -> list[Path]:
    """Write ``<name>.csv`` (the rows), ``.md`` (table, override, notes), ``.png`` and ``.json`` (the result and
    ``tune.*``) into ``out``; returns their paths."""
    from runner.track import write_json_atomic

    kind = tuner.name
    out.mkdir(parents=True, exist_ok=True)
    rows, rec = result["rows"], result["recommended"]
    keys = list(dict.fromkeys(k for r in rows for k in r))
    csv_path = out / f"{kind}.csv"
    with open_own(csv_path, newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows([{k: ("" if r.get(k) is None else r.get(k)) for k in keys} for r in rows])
    md = [
        f"# runner.tune {kind}",
        "",
        f"model `{cfg.model._target_}`, data `{cfg.data.name}`, device "
        f"{result['device']}, {result['world_size']} process(es)",
        "",
        markdown_table(tuner, rows, rec, max_rows=tuner.console_rows and 2 * tuner.console_rows),
        "",
        f"**override:** `{result['override']}`",
        "",
        *([f"**run it:** `{result['command']}`", ""] if result.get("command") else []),
        *[f"- {n}" for n in result["notes"]],
        "",
    ]
    md_path = out / f"{kind}.md"
    write_own(md_path, "\n".join(md))
    png_path = out / f"{kind}.png"
    plot(tuner, result, png_path)
    extra = []
    for name, text in result.get("files", {}).items():  # a tuner's own files, e.g. speed's experiment/tuned.yaml
        path = out / name
        if not text:  # the tuner has none to write this time (speed: no change): an earlier run's copy goes
            path.unlink(missing_ok=True)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        write_own(path, text)
        extra.append(path)
    json_path = out / f"{kind}.json"
    write_json_atomic(
        json_path,
        {"tuner": kind, **{k: v for k, v in result.items() if k != "files"}, "tune": OmegaConf.to_container(cfg.tune)},
    )
    return [csv_path, md_path, png_path, json_path, *extra]


# ------------------------------------------------------------------------------------------- entry


#: When the running tuner's command started (``time.perf_counter()``), set by ``run``: ``tune.budget_minutes`` counts
#: the command's wall time from here (runner/tune/speed.py)
COMMAND_STARTED_S = [0.0]


def run(tuner: Tuner, cfg: DictConfig, out: Path, started_s: float | None = None) -> dict[str, Any]:
    """Run ``tuner`` on the composed run config ``cfg``; rank 0 writes the outputs into ``out`` and prints
    the table and the override line. Returns the result (``recommended``, ``override``, ``rows``, ``notes``,
    ``device``, ``world_size``, ``tune_time_s`` in seconds, ``ranks``: each rank's recommendation).
    ``started_s``: when the command started (``python -m runner.tune``: runner's import), else now.

    Raises:
        ConfigError: bad ``tune.*`` values, bad run config (``runner.engine.validate.validate`` and the builders), or
            nothing to recommend (the job does not fit at the smallest batch size, ...).
        RuntimeError: the ranks' recommendations differ (a bug: they decide on the same reduced figures).
    """
    from runner import distributed
    from runner.engine.validate import validate
    from runner.measure import hardware

    COMMAND_STARTED_S[0] = time.perf_counter() if started_s is None else started_s
    validate(cfg)
    check_settings(cfg.tune)
    env = distributed.setup(cfg.distributed, cfg.trainer.device)
    try:
        out = distributed.shared_job_dir(Path(out), env)
        with tempfile.TemporaryDirectory(prefix="runner-tune-") as scratch:  # the trials' job folders
            started = time.perf_counter()
            result = tuner.tune(cfg, env, Path(scratch))
        result |= {
            "device": hardware.device_name(env.device),
            "world_size": env.world_size,
            "tune_time_s": time.perf_counter() - started,
        }
        busy = load_note(result["rows"])
        if busy:
            result["notes"] = [busy, *result["notes"]]
        result["ranks"] = gather(result["recommended"], env)
        if any(r != result["ranks"][0] for r in result["ranks"]):
            raise RuntimeError(f"the ranks recommend different settings: {result['ranks']}")
        if env.is_main:
            paths = write_outputs(tuner, result, cfg, out)
            print(f"\n{markdown_table(tuner, result['rows'], result['recommended'], max_rows=tuner.console_rows)}\n")
            for note in result["notes"]:
                print(note if note.startswith("warning:") else f"note: {note}")
            print(f"\nwrote {', '.join(p.name for p in paths)} in {out}")
            print(f"override: {result['override']}", flush=True)
            if result.get("command"):
                print(f"run it: {result['command']}", flush=True)
        return result
    finally:
        distributed.teardown()
