"""The speed doctor: what limits a run's speed, the figures that show it, and the overrides to try.

    python -m runner.doctor <job folder>                  # the diagnosis (also printed after every run)
    python -m runner.doctor <job folder> --verify         # and measure what each suggestion really buys

It reads what the run recorded in its folder: ``summary.json`` (the figures, ``machine_load`` and its
``warnings``, the resolved config), ``metrics.jsonl`` (per-interval figures), ``.hydra/overrides.yaml``
(the command) and ``.hydra/hydra.yaml`` (the folder it ran from, a ``--config-dir``). ``diagnose`` turns a
summary into ``Finding``s, each a category with its evidence in figures and ranked suggestions; every
suggestion is printed as a command to paste: ``python -m runner <the job's overrides> <the suggestion>``.
The categories, in the order they are checked:

- **untrustworthy**: the run's machine-load warnings (``runner.measure.load_warnings``): rerun on a quiet
  machine before trusting any figure below;
- **not measured**: every step was warm-up;
- **debug tools on**: ``debug=anomaly|profile`` slows every step (PyTorch Performance Tuning Guide,
  "disable debugging APIs");
- **input-bound**: the data-wait fraction is high: DataLoader workers, pinned memory, the dataset on the
  device (PyTorch DataLoader docs; airbench);
- **host/launch-bound** (CUDA): the GPU idles between kernels in a short profiler window of the warm-up
  (``runner.measure.GpuIdleProbe``): CUDA graphs (``compile=reduce-overhead``), a larger batch;
- **sync/overhead-bound**: a host-device sync (the loss read at a log step) every step or two, logging a
  large share of the time, or a step doing little arithmetic for its time (fixed per-step costs: Python,
  op dispatch, per-parameter optimizer work): raise ``trainer.log_every``, a larger batch, compile;
- **memory-bound**: peak memory near the device's: bf16, activation checkpointing, gradient accumulation;
- **near the hardware ceiling**: MFU high: nothing big left.

Thresholds are the module constants below, each with why. ``--verify`` runs the job and each suggestion
(short runs, in fresh processes forked one after the other from the ablation's job server, the repeat
as the outer loop) and reports the speed-up of each over the job's own rerun: a ratio of medians with
its bootstrap interval and verdict (``runner.stats``, as the ablation report).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runner import stats
from runner.errors import ConfigError

# ------------------------------------------------------------------------------------------ thresholds
#: Data wait above 10 % of the measured time: a loader that keeps up waits ~0 (the next batch is ready);
#: 10 % is where the ablation of docs/ablation-cpu.md saw workers start paying for themselves.
DATA_WAIT_FRACTION_MAX = 0.10
#: The GPU idle between kernels more than 20 % of a warm-up window beyond its data wait: kernel launches
#: and Python are the step's critical path (CUDA graphs remove launches; torch.compile docs).
GPU_IDLE_FRACTION_MAX = 0.20
#: Logging steps' bookkeeping (the loss read, the metrics row, the console line) above 5 % of the measured
#: time: with the default trainer.log_every=50 it is well under 1 %.
LOG_TIME_FRACTION_MAX = 0.05
#: A host-device sync every second step or more often (trainer.log_every <= 2, or on_nonfinite=skip):
#: on CUDA each one drains the queue, so the GPU idles while Python prepares the next step.
SYNCS_PER_STEP_MAX = 0.5
#: A CPU core sustains tens of GFLOP/s in fp32 matmuls and convolutions (AVX2/AVX-512); a step computing
#: below 1 GFLOP/s per thread spends its time elsewhere: Python, op dispatch, per-parameter optimizer work.
CPU_FLOPS_PER_THREAD_MIN = 1e9
#: Peak memory above 85 % of the device's: the next larger batch or model does not fit, and on CUDA the
#: caching allocator starts to free and retry (fragmentation).
MEMORY_FRACTION_MAX = 0.85
#: MFU of 50 %: about the best dense training reaches (PaLM 46 %, Megatron-LM ~50 %); little is left.
MFU_HIGH = 0.5
#: Default step count of --verify runs when the job set no trainer.max_steps (an epoch would be long):
#: enough measured steps for a median after the job's warm-up.
VERIFY_MEASURED_STEPS = 30

CATEGORIES = ("untrustworthy", "not measured", "debug tools on", "input-bound", "host/launch-bound",
              "sync/overhead-bound", "memory-bound", "near the hardware ceiling")
#: Datasets with an in-memory form, so ``dataloader=device`` applies (runner/data.py; a custom dataset only
#: when it is a TensorDataset, which the summary cannot tell).
IN_MEMORY_DATA = ("mnist", "cifar10", "synthetic", "text")
#: What every --verify run adds to the job's overrides: quiet, short, no files beyond the figures.
VERIFY_FIXED = ["logger=none", "trainer.progress=off", "trainer.doctor=false", "checkpoint.at_end=false",
                "checkpoint.every_steps=null", "checkpoint.every_minutes=null", "checkpoint.resume=never",
                "trainer.eval_max_batches=1"]


@dataclass
class Suggestion:
    """Overrides to add to the job's command line (``["dataloader.num_workers=2"]``) and why they help."""

    overrides: list[str]
    why: str


@dataclass
class Finding:
    """One diagnosis: its category (one of ``CATEGORIES``), the evidence in figures, the share of the
    measured time at stake (``score``, 0..1, ranks the findings; 1 for a debug tool, which is never worth
    its cost in a speed run) and its suggestions, best first."""

    category: str
    evidence: str
    score: float
    suggestions: list[Suggestion] = field(default_factory=list)


def _get(config: dict[str, Any], dotted: str, default: Any = None) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        else None


# ------------------------------------------------------------------------------------------- diagnosis
def diagnose(summary: dict[str, Any], config: dict[str, Any] | None = None,
             metrics: list[dict[str, Any]] | None = None) -> list[Finding]:
    """The findings for one run, most important first (untrustworthy figures always lead).

    Args:
        summary: the run's ``summary.json`` (figures as runner writes them; missing keys are skipped).
        config: the resolved config; defaults to ``summary["config"]``.
        metrics: ``metrics.jsonl`` rows (optional): per-interval data wait, and the log cadence of an
            older summary without ``host_syncs_per_step``.

    Returns:
        Findings sorted by ``score`` (descending) after the untrustworthy one; empty when nothing crosses
        a threshold.
    """
    config = config if config is not None else summary.get("config") or {}
    metrics = metrics or []
    device = summary.get("device") or "cpu"
    cuda = device == "cuda"
    findings: list[Finding] = []
    lead: list[Finding] = []

    warnings = summary.get("warnings") or []
    if warnings:
        lead.append(Finding("untrustworthy", "; ".join(warnings), 1.0, [Suggestion(
            [], "rerun the same command on a quiet machine: until then the findings below may be noise")]))
    sps = _num(summary.get("samples_per_sec"))
    if sps is None:
        warmup = int(summary.get("warmup_steps") or _get(config, "trainer.warmup_steps", 5) or 0)
        lead.append(Finding("not measured", str(summary.get("measurement") or "no speed figure"), 1.0,
                            [Suggestion([f"trainer.max_steps={warmup + VERIFY_MEASURED_STEPS}"],
                                        "measured steps after the warm-up")]))
        return lead

    debug = _get(config, "debug.name", "off")
    if debug not in (None, "off"):
        what = {"anomaly": "autograd anomaly detection checks every backward op and records forward "
                           "tracebacks", "profile": "the profiler records every op of its window"}.get(debug, debug)
        findings.append(Finding("debug tools on", f"debug={debug}: {what}; no speed figure of such a run is "
                                                  "representative", 1.0,
                                [Suggestion(["debug=off"], "debug tools only while debugging")]))

    wait = _num(summary.get("data_wait_fraction")) or 0.0
    if wait >= DATA_WAIT_FRACTION_MAX:
        findings.append(_input_bound(summary, config, wait, metrics, cuda))

    idle = _num(summary.get("gpu_idle_fraction"))
    if cuda and idle is not None and idle - wait >= GPU_IDLE_FRACTION_MAX:
        batch = _get(config, "dataloader.batch_size")
        sugg = []
        if _get(config, "compile.mode") != "reduce-overhead":
            sugg.append(Suggestion(["compile=reduce-overhead"], "CUDA graphs: the whole step launched at once"))
        if batch:
            sugg.append(Suggestion([f"dataloader.batch_size={2 * batch}"],
                                   "twice the work per launch (keep the LR rule: optimizer.lr_scaling)"))
        findings.append(Finding("host/launch-bound",
                                f"the GPU idled {idle:.0%} of a profiled warm-up window between kernels "
                                f"(data wait {wait:.0%}): it waits for the host to launch work", idle - wait, sugg))

    overhead = _overhead(summary, config, wait, cuda, metrics)
    if overhead is not None:
        findings.append(overhead)

    peak, limit = _num(summary.get("peak_memory_mb")), _num(summary.get("memory_limit_mb"))
    if peak and limit and peak / limit >= MEMORY_FRACTION_MAX:
        findings.append(_memory_bound(config, peak, limit, cuda))

    mfu = _num(summary.get("mfu"))
    if mfu is not None and mfu >= MFU_HIGH:
        findings.append(Finding("near the hardware ceiling", f"MFU {mfu:.0%} of the device's dense peak: nothing "
                                                             "big is left to gain from switches; a smaller model "
                                                             "or more devices go further", 0.0))
    findings.sort(key=lambda f: -f.score)
    return lead + findings


def _input_bound(summary: dict[str, Any], config: dict[str, Any], wait: float, metrics: list[dict[str, Any]],
                 cuda: bool) -> Finding:
    workers = int(_get(config, "dataloader.num_workers", 0) or 0)
    cores = (summary.get("machine_load") or {}).get("cpu_cores") or os.cpu_count() or 1
    rows = [r for r in metrics if _num(r.get("data_wait_ms")) is not None and _num(r.get("step_time_ms"))]
    high = sum(r["data_wait_ms"] / (r["data_wait_ms"] + r["step_time_ms"]) >= DATA_WAIT_FRACTION_MAX for r in rows)
    steady = f"; in {high} of {len(rows)} log intervals" if rows else ""
    evidence = (f"{wait:.0%} of the measured time waited for the next batch (data_wait_fraction {wait:.3f}"
                f"{steady}; dataloader.num_workers={workers})")
    sugg = []
    if workers < cores:
        n = min(cores, 4) if workers == 0 else min(cores, 2 * workers)
        sugg.append(Suggestion([f"dataloader.num_workers={n}"],
                               f"load batches in {n} worker processes while the step runs"))
    if cuda and not _get(config, "dataloader.pin_memory"):
        sugg.append(Suggestion(["dataloader.pin_memory=true", "dataloader.non_blocking=true"],
                               "page-locked batches, asynchronous host-to-device copies"))
    if _get(config, "data.name") in IN_MEMORY_DATA and not _get(config, "dataloader.on_device"):
        sugg.append(Suggestion(["dataloader=device"], "the whole dataset as tensors on the device: no loader"))
    if not sugg:
        sugg.append(Suggestion([], "the loader already uses every core: make __getitem__ cheaper (decode once, "
                                   "cache, smaller images)"))
    return Finding("input-bound", evidence, wait, sugg)


def _overhead(summary: dict[str, Any], config: dict[str, Any], wait: float, cuda: bool,
              metrics: list[dict[str, Any]]) -> Finding | None:
    """The sync/overhead-bound finding, or None: syncs per step, logging's share, arithmetic per second."""
    log_every = int(_get(config, "trainer.log_every", 50) or 50)
    syncs = _num(summary.get("host_syncs_per_step"))
    if syncs is None and metrics and summary.get("steps"):  # an older summary: count the loss reads
        syncs = sum("loss" in r for r in metrics) / summary["steps"]
    log_share = _num(summary.get("log_time_fraction"))
    evidence, score = [], 0.0
    if syncs is not None and syncs >= SYNCS_PER_STEP_MAX:
        evidence.append(f"{syncs:g} host-device sync(s) per step (trainer.log_every={log_every}"
                        + (", trainer.on_nonfinite=skip" if _get(config, "trainer.on_nonfinite") == "skip" else "")
                        + ")")
        score = max(score, 0.05)
    if log_share is not None and log_share >= LOG_TIME_FRACTION_MAX:
        evidence.append(f"logging took {log_share:.0%} of the measured time")
        score = max(score, log_share)
    threads = ((summary.get("machine_load") or {}).get("threads")) or 1
    flops, step_ms = _num(summary.get("flops_per_sample")), _num(summary.get("step_time_ms_median"))
    batch = summary.get("global_batch_size")
    if not cuda and flops and step_ms and batch:
        rate = flops * batch / (step_ms / 1e3)  # FLOP/s while computing (data wait excluded)
        floor = CPU_FLOPS_PER_THREAD_MIN * threads
        if rate < floor:
            evidence.append(f"a {step_ms:.3g} ms step computes only {rate / 1e9:.2g} GFLOP/s on {threads} "
                            f"thread(s) (< {floor / 1e9:g}): fixed per-step costs (Python, op dispatch, the "
                            f"optimizer's per-parameter work) dominate")
            score = max(score, (1 - wait) * (1 - rate / floor))
    if not evidence:
        return None
    sugg = []
    if (syncs is not None and syncs >= SYNCS_PER_STEP_MAX) or (log_share or 0.0) >= LOG_TIME_FRACTION_MAX:
        if log_every < 50:
            sugg.append(Suggestion(["trainer.log_every=50"], "read the loss (a sync) and log every 50 steps"))
        if _get(config, "trainer.on_nonfinite") == "skip":
            sugg.append(Suggestion(["trainer.on_nonfinite=stop"], "no per-step gradient check (a sync per step)"))
    micro = _get(config, "dataloader.batch_size")
    if micro:
        sugg.append(Suggestion([f"dataloader.batch_size={2 * micro}"],
                               "per-step costs paid once per twice the samples (keep the LR rule: "
                               "optimizer.lr_scaling)"))
    mode = _get(config, "compile.mode")
    if cuda and mode != "reduce-overhead":
        sugg.append(Suggestion(["compile=reduce-overhead"], "one compiled graph, launched as a CUDA graph"))
    elif not cuda and mode is None:
        sugg.append(Suggestion(["compile=default"], "fused kernels, fewer Python-level ops (compiling takes time)"))
    return Finding("sync/overhead-bound", "; ".join(evidence), score, sugg)


def _memory_bound(config: dict[str, Any], peak: float, limit: float, cuda: bool) -> Finding:
    from runner.hardware import cpu_has_native_bf16

    sugg = []
    if _get(config, "precision.name") in ("fp32", "tf32") and (cuda or cpu_has_native_bf16()):
        sugg.append(Suggestion(["precision=bf16"], "bf16 activations: about half the activation memory"))
    if not _get(config, "memory.checkpointing"):
        sugg.append(Suggestion(["memory=checkpointing"], "recompute activations in backward (~1 extra forward)"))
    micro, accumulate = _get(config, "dataloader.batch_size"), _get(config, "memory.accumulate_steps", 1) or 1
    if micro and micro >= 2:
        sugg.append(Suggestion([f"dataloader.batch_size={micro // 2}", f"memory.accumulate_steps={2 * accumulate}"],
                               "half the micro-batch, the same global batch"))
    what = "the GPU's memory" if cuda else "the machine's memory (peak RSS)"
    return Finding("memory-bound", f"peak memory {peak:,.0f} MiB is {peak / limit:.0%} of {what} ({limit:,.0f} MiB)",
                   peak / limit - MEMORY_FRACTION_MAX, sugg)


# ------------------------------------------------------------------------------------------- the job folder
@dataclass
class Job:
    """What the doctor reads from a job folder."""

    folder: Path
    summary: dict[str, Any]
    config: dict[str, Any]
    overrides: list[str]  # the task overrides of the command line (.hydra/overrides.yaml)
    metrics: list[dict[str, Any]]
    cwd: Path | None  # where the job ran from (hydra.runtime.cwd): relative paths and run-folder modules
    searchpath: list[str]  # config search path entries the command added (--config-dir, hydra.searchpath)


def load_job(folder: Path) -> Job:
    """Read ``summary.json``, ``metrics.jsonl`` and ``.hydra/`` of a job folder.

    Raises:
        ConfigError: no such folder, no ``summary.json`` (the run failed or is still running), or a file
            that cannot be read (its path and the fix).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"{folder} is not a folder; pass a job folder of `python -m runner` "
                          f"(outputs/<date>/<time>, or outputs/multirun/<date>/<time>/<n>)")
    path = folder / "summary.json"
    if not path.is_file():
        raise ConfigError(f"{folder} has no summary.json: the run failed, was stopped or is still running (a "
                          f"summary is written only at the end of a finished run); pass a finished job's folder")
    summary = _read_json(path)
    metrics = []
    if (folder / "metrics.jsonl").is_file():
        for line in (folder / "metrics.jsonl").read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut by a kill
            if isinstance(row, dict):
                metrics.append(row)
    overrides, cwd, searchpath = [], None, []
    hydra_dir = folder / ".hydra"
    if hydra_dir.is_dir():
        from omegaconf import OmegaConf

        try:
            if (hydra_dir / "overrides.yaml").is_file():
                overrides = [str(o) for o in OmegaConf.load(hydra_dir / "overrides.yaml")]
            if (hydra_dir / "hydra.yaml").is_file():
                hydra = OmegaConf.load(hydra_dir / "hydra.yaml").hydra
                cwd = Path(hydra.runtime.cwd)
                searchpath = [str(p) for p in hydra.searchpath] + [
                    f"{s.schema}://{s.path}" for s in hydra.runtime.config_sources if s.provider == "command-line"]
        except Exception as e:  # noqa: BLE001 - OmegaConf/YAML errors of a damaged file: one message
            raise ConfigError(f"{hydra_dir} cannot be read ({type(e).__name__}: {e}); the diagnosis needs the "
                              f"job's .hydra folder as Hydra wrote it") from e
    config = summary.get("config")
    if not isinstance(config, dict) and (hydra_dir / "config.yaml").is_file():
        from omegaconf import OmegaConf

        config = OmegaConf.to_container(OmegaConf.load(hydra_dir / "config.yaml"), resolve=False)
    return Job(folder, summary, config or {}, overrides, metrics, cwd, searchpath)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} cannot be read ({e}); run the job again") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not a JSON object; run the job again")
    return data


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def merge_overrides(base: list[str], extra: list[str]) -> list[str]:
    """``base`` with ``extra`` added; an override of ``extra`` replaces ``base``'s of the same key (Hydra
    refuses a key given twice), in place, so the command reads like the original."""
    keys = {_key(o): o for o in extra}
    merged = [keys.pop(_key(o)) if _key(o) in keys else o for o in base]
    return merged + [o for o in extra if _key(o) in keys]


def command(job: Job, extra: list[str]) -> str:
    """The shell command of the job with ``extra`` overrides (quoted for a POSIX shell)."""
    config_dirs = [p.removeprefix("file://") for p in job.searchpath if p.startswith("file://")]
    prefix = ["python", "-m", "runner"] + [a for d in config_dirs for a in ("--config-dir", d)]
    return shlex.join(prefix + merge_overrides(job.overrides, extra))


def render(findings: list[Finding], job: Job, warnings_shown: bool = False) -> str:
    """The diagnosis as text: one block per finding (category, evidence, one command per suggestion).
    ``warnings_shown``: the run's summary table just printed the machine-load warnings, so the
    untrustworthy finding points to them instead of repeating them."""
    s = job.summary
    figures = [f"samples/s {s['samples_per_sec']:,.4g}" if _num(s.get("samples_per_sec")) else None,
               f"step {s['step_time_ms_median']:.3g} ms" if _num(s.get("step_time_ms_median")) else None,
               f"data wait {s['data_wait_fraction']:.0%}" if _num(s.get("data_wait_fraction")) is not None else None,
               f"MFU {s['mfu']:.0%}" if _num(s.get("mfu")) is not None else None]
    lines = [f"speed doctor ({', '.join(f for f in figures if f)}):"]
    if not findings:
        lines.append("  no bottleneck above the doctor's thresholds (runner/doctor.py); measure a switch with "
                     "`python -m runner -m +experiment=ablation ...`")
    for i, f in enumerate(findings, 1):
        evidence = f.evidence
        if f.category == "untrustworthy" and warnings_shown:
            evidence = f"the machine-load warning(s) above ({len(job.summary.get('warnings') or [])} in summary.json)"
        lines.append(f"  {i}. {f.category}: {evidence}")
        for sug in f.suggestions:
            if sug.overrides:
                lines.append(f"     try: {command(job, sug.overrides)}   # {sug.why}")
            else:
                lines.append(f"     {sug.why}")
    if s.get("device") != "cuda":
        lines.append("  (host/launch-bound is a CUDA check: a CPU run has no GPU to idle)")
    if any(sug.overrides for f in findings for sug in f.suggestions):
        lines.append(f"  measure them: python -m runner.doctor {shlex.quote(str(job.folder))} --verify")
    return "\n".join(lines)


def report(folder: Path, warnings_shown: bool = False) -> str:
    """The diagnosis of the job in ``folder`` as printed text (``load_job`` + ``diagnose`` + ``render``)."""
    job = load_job(folder)
    return render(diagnose(job.summary, job.config, job.metrics), job, warnings_shown)


# ------------------------------------------------------------------------------------------- --verify
@dataclass
class Trial:
    """One configuration of --verify: its label, overrides added to the job's, and each repeat's samples/s
    (None for a run that failed or measured nothing)."""

    label: str
    overrides: list[str]
    folder: str
    runs: list[float | None] = field(default_factory=list)
    speedup: float | None = None
    interval: stats.Interval | None = None
    verdict: str = ""

    @property
    def measured(self) -> list[float]:
        return [r for r in self.runs if r is not None]

    @property
    def median(self) -> float | None:
        return statistics.median(self.measured) if self.measured else None


def verify_plan(job: Job, findings: list[Finding], top: int | None = None) -> list[Trial]:
    """The job's own rerun first, then each distinct suggestion with overrides, in the diagnosis's order
    (the first ``top`` of them when given)."""
    trials = [Trial("the job (rerun)", [], "job")]
    seen: set[tuple[str, ...]] = set()
    for f in findings:
        for sug in f.suggestions:
            key = tuple(sug.overrides)
            if sug.overrides and key not in seen:
                seen.add(key)
                trials.append(Trial(" ".join(sug.overrides), list(sug.overrides), f"s{len(trials)}"))
    return trials if top is None else trials[:top + 1]


def verify_steps(job: Job, steps: int | None) -> int:
    """Steps of each --verify run: ``steps``, else the job's ``trainer.max_steps``, else its warm-up +
    ``VERIFY_MEASURED_STEPS``.

    Raises:
        ConfigError: a step count that leaves nothing measured after the warm-up.
    """
    warmup = int(_get(job.config, "trainer.warmup_steps", 0) or 0)
    chosen = steps or _get(job.config, "trainer.max_steps") or warmup + VERIFY_MEASURED_STEPS
    if chosen <= warmup:
        raise ConfigError(f"--steps {chosen} leaves no measured step after the job's trainer.warmup_steps={warmup}; "
                          f"give --steps {warmup + VERIFY_MEASURED_STEPS}")
    return int(chosen)


def compose_job(job: Job, overrides: list[str]):
    """The job's config with ``overrides`` (Hydra's compose API on runner's conf/ and the job's search path),
    resolved, as ``python -m runner`` would compose it.

    Raises:
        ConfigError: the overrides do not compose (Hydra's message).
    """
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from runner import CONF_DIR
    from runner.config import register_configs

    register_configs()
    extra = [f"hydra.searchpath=[{','.join(job.searchpath)}]"] if job.searchpath else []
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="config", overrides=[*extra, *overrides])
        OmegaConf.resolve(cfg)
    except Exception as e:  # noqa: BLE001 - Hydra's compose errors come in several types; one message
        raise ConfigError(f"the overrides {' '.join(overrides)} do not compose: {e}") from e
    return cfg


def verify(job: Job, findings: list[Finding], steps: int | None = None, repeats: int = 3,
           out: Path | None = None, top: int | None = None) -> tuple[list[Trial], Path]:
    """Run the job and each suggestion (the first ``top``) ``repeats`` times (repeat = outer loop) for ``verify_steps`` steps,
    each in a fresh process forked from the ablation's job server (``runner.ablation.fork_train``), from
    the folder the job ran in; then each suggestion's speed-up over the job's rerun: median samples/s ÷
    the rerun's median, its 95 % bootstrap interval and verdict (``runner.stats``; with one repeat no
    interval). Writes ``verify.json`` and ``verify.md`` into ``out`` (default
    ``<job>/doctor-verify/<date>_<time>``).

    Raises:
        ConfigError: a multi-process job (verify runs one process), bad ``repeats``/``steps``, overrides
            that do not compose, or the job's own rerun measuring nothing.
    """
    from runner.ablation import fork_train

    if repeats < 1:
        raise ConfigError(f"--repeats {repeats}: give 1 or more (3 for an interval)")
    if top is not None and top < 1:
        raise ConfigError(f"--top {top}: give 1 or more (or leave it out: every suggestion)")
    if (job.summary.get("world_size") or 1) > 1:
        raise ConfigError(f"{job.folder} ran on {job.summary['world_size']} processes; --verify reruns one "
                          f"process: measure under torchrun with `python -m runner -m +experiment=ablation`")
    n_steps = verify_steps(job, steps)
    trials = verify_plan(job, findings, top)
    if len(trials) == 1:
        raise ConfigError(f"the diagnosis of {job.folder} suggests no override to verify")
    out = Path(out) if out else job.folder / "doctor-verify" / time.strftime("%Y-%m-%d_%H-%M-%S")
    out.mkdir(parents=True, exist_ok=True)
    configs = {t.folder: compose_job(job, merge_overrides(job.overrides, [*t.overrides, f"trainer.max_steps={n_steps}",
                                                                          *VERIFY_FIXED]))
               for t in trials}  # every configuration composes before anything runs
    print(f"verify: {len(trials)} configurations x {repeats} repeat(s), {n_steps} steps each, into {out}", flush=True)
    here, path = Path.cwd(), list(sys.path)
    try:
        if job.cwd is not None and job.cwd.is_dir():
            os.chdir(job.cwd)  # the children start here: relative paths and run-folder modules as in the job
            sys.path.insert(0, str(job.cwd))
        for repeat in range(repeats):
            for t in trials:
                folder = (out / t.folder / f"r{repeat}").resolve()
                status = fork_train(configs[t.folder], folder, {}, f"doctor {t.folder}/r{repeat}")
                summary = folder / "summary.json"
                sps = _num(_read_json(summary).get("samples_per_sec")) if status == 0 and summary.is_file() else None
                t.runs.append(sps)
                print(f"verify: {t.label} r{repeat}: " + (f"{sps:,.1f} samples/s" if sps else
                                                          f"no figure (exit status {status})"), flush=True)
    finally:
        os.chdir(here)
        sys.path[:] = path
    base = trials[0]
    if base.median is None:
        raise ConfigError(f"the job's own rerun measured nothing (see its output above and {out / base.folder}); "
                          f"nothing to compare against")
    for t in trials:
        if t.median is None:
            t.verdict = "failed (see its folder)"
            continue
        t.speedup = t.median / base.median
        if t is base:
            t.verdict = "reference"
            continue
        t.interval = stats.ratio_interval(t.measured, base.measured, name=t.label, reference_name=base.label)
        t.verdict = stats.verdict(t.interval)
    _write_verify(job, trials, n_steps, repeats, out)
    return trials, out


def verify_table(trials: list[Trial]) -> list[str]:
    """The --verify result as markdown table lines (also what the console shows)."""
    lines = ["| configuration | samples/s (median) | runs | × the job's rerun | 95 % CI | verdict |",
             "|---|---:|---:|---:|---|---|"]
    for t in trials:
        ci = f"[{t.interval.low:.2f}, {t.interval.high:.2f}]" if t.interval else "–"
        med = f"{t.median:,.1f}" if t.median is not None else "–"
        ratio = f"{t.speedup:.2f}" if t.speedup is not None else "–"
        lines.append(f"| {t.label} | {med} | {len(t.measured)}/{len(t.runs)} | {ratio} | {ci} | {t.verdict} |")
    return lines


def _write_verify(job: Job, trials: list[Trial], steps: int, repeats: int, out: Path) -> None:
    from runner.track import write_json_atomic

    record = {"job": str(job.folder), "steps": steps, "repeats": repeats, "command": command(job, []),
              "trials": [{"label": t.label, "overrides": t.overrides, "folder": t.folder, "samples_per_sec": t.runs,
                          "median_samples_per_sec": t.median, "speedup": t.speedup,
                          "ci_low": t.interval.low if t.interval else None,
                          "ci_high": t.interval.high if t.interval else None, "verdict": t.verdict,
                          "command": command(job, t.overrides)} for t in trials]}
    write_json_atomic(out / "verify.json", record)
    text = [f"# What the doctor's suggestions buy: {job.folder}", "",
            f"Each configuration ran {repeats} time(s) for {steps} steps (the job's warm-up left out), one fresh "
            f"process each, repeats as the outer loop. Speed-up = median samples/s ÷ the job's rerun's; 95 % "
            f"bootstrap interval of that ratio ({stats.RESAMPLES:,} resamples, runner/stats.py); helps/hurts "
            f"when the whole interval lies above/below 1.", "", *verify_table(trials), ""]
    (out / "verify.md").write_text("\n".join(text))


# ------------------------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    """``python -m runner.doctor JOB [--verify] [--steps N] [--repeats N] [--top N] [--out DIR]``; returns the exit
    status (2: a folder or an option the doctor cannot use)."""
    parser = argparse.ArgumentParser(prog="python -m runner.doctor", description=__doc__.split("\n\n")[0])
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


if __name__ == "__main__":
    sys.exit(main())
