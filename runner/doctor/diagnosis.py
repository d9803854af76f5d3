"""The diagnosis: thresholds (each with why), ``Finding`` and ``diagnose`` (summary.json -> ranked findings)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from runner.techniques import TECHNIQUES, Job

# ------------------------------------------------------------------------------------------ thresholds
#: Data wait above 10 % of the measured time: a loader that keeps up waits ~0; from 10 % on, workers paid for
#: themselves in the rounds ablation of resnet18/CIFAR-10 (2026-11-23, docs/benchmarks/ablation-methods.md).
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
#: The EMA's update (trainer.ema_decay) above 5 % of the step: updating every N-th step with decay**N keeps the
#: average's horizon (about 1 / (1 - decay) steps) at 1/N of the cost.
EMA_STEP_FRACTION_MAX = 0.05
#: A log row's gradient norm above 10x the median of the rows before it (at least 5 of them): a loss spike
#: in the making (the LLM trainers' reason to log the norm; clipping at ~1 is their fix).
GRAD_NORM_SPIKE = 10.0
#: Default step count of --verify runs when the job set no trainer.max_steps (an epoch would be long):
#: enough measured steps for a median after the job's warm-up.
VERIFY_MEASURED_STEPS = 30

CATEGORIES = (
    "untrustworthy",
    "not measured",
    "debug tools on",
    "input-bound",
    "host/launch-bound",
    "sync/overhead-bound",
    "memory-bound",
    "near the hardware ceiling",
    "gradient spikes",
)


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
    return (
        float(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        else None
    )


# ------------------------------------------------------------------------------------------- diagnosis
def diagnose(
    summary: dict[str, Any], config: dict[str, Any] | None = None, metrics: list[dict[str, Any]] | None = None
) -> list[Finding]:
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
    job = Job.recorded(config, device)  # where a suggestion acts: the technique table decides
    findings: list[Finding] = []
    lead: list[Finding] = []

    warnings = summary.get("warnings") or []
    if warnings:
        lead.append(Finding("untrustworthy", "; ".join(warnings), 1.0, _busy_machine(summary, device)))
    sps = _num(summary.get("samples_per_sec"))
    if sps is None:
        warmup = int(summary.get("warmup_steps") or _get(config, "trainer.warmup_steps", 5) or 0)
        lead.append(
            Finding(
                "not measured",
                str(summary.get("measurement") or "no speed figure"),
                1.0,
                [
                    Suggestion(
                        [f"trainer.max_steps={warmup + VERIFY_MEASURED_STEPS}"], "measured steps after the warm-up"
                    )
                ],
            )
        )
        return lead

    debug = _get(config, "debug.name", "off")
    if debug not in (None, "off"):
        what = {
            "anomaly": "autograd anomaly detection checks every backward op and records forward tracebacks",
            "profile": "the profiler records every op of its window",
        }.get(debug, debug)
        findings.append(
            Finding(
                "debug tools on",
                f"debug={debug}: {what}; no speed figure of such a run is representative",
                1.0,
                [Suggestion(["debug=off"], "debug tools only while debugging")],
            )
        )

    wait = _num(summary.get("data_wait_fraction")) or 0.0
    if wait >= DATA_WAIT_FRACTION_MAX:
        findings.append(_input_bound(summary, job, wait, metrics))

    idle = _num(summary.get("gpu_idle_fraction"))
    if job.cuda and idle is not None and idle - wait >= GPU_IDLE_FRACTION_MAX:
        findings.append(_launch_bound(config, idle, wait))

    overhead = _overhead(summary, job, wait, metrics)
    if overhead is not None:
        findings.append(overhead)

    peak, limit = _num(summary.get("peak_memory_mb")), _num(summary.get("memory_limit_mb"))
    if peak and limit and peak / limit >= MEMORY_FRACTION_MAX:
        findings.append(_memory_bound(job, peak, limit))

    ema = _ema_cost(summary, config)
    if ema is not None:
        findings.append(ema)
    spikes = _gradient_spikes(config, metrics)
    if spikes is not None:
        findings.append(spikes)

    mfu = _num(summary.get("mfu"))
    if mfu is not None and mfu >= MFU_HIGH:
        findings.append(
            Finding(
                "near the hardware ceiling",
                f"MFU {mfu:.0%} of the device's dense peak: nothing "
                "big is left to gain from switches; a smaller model "
                "or more devices go further",
                0.0,
            )
        )
    findings.sort(key=lambda f: -f.score)
    return lead + findings


def _busy_machine(summary: dict[str, Any], device: str) -> list[Suggestion]:
    """What helps a run measured on a busy machine: on a CPU where runner's threads outnumbered the cores the
    other processes left free, ``trainer.num_threads`` at that count (``runner.measure.machine_load.threads_that_fit``,
    as the run's warning says); always, a rerun on a quiet machine."""
    rerun = Suggestion([], "rerun the same command on a quiet machine: until then the findings below may be noise")
    if device != "cpu" or not summary.get("machine_load"):
        return [rerun]
    from runner.measure.machine_load import threads_that_fit  # imports torch: only for a run measured on a busy CPU

    fit = threads_that_fit(summary["machine_load"])
    if fit is None:
        return [rerun]
    return [
        Suggestion(
            [f"trainer.num_threads={fit}"],
            f"{fit} intra-op thread(s) for the {fit} core(s) the other "
            f"processes left free: threads that outnumber the free cores wait for them (the default stays "
            f"one per core: a count read from the load at start would change with whatever ran then)",
        ),
        rerun,
    ]


def _input_bound(summary: dict[str, Any], job: Job, wait: float, metrics: list[dict[str, Any]]) -> Finding:
    config = job.cfg
    workers = int(_get(config, "dataloader.num_workers", 0) or 0)
    cores = (summary.get("machine_load") or {}).get("cpu_cores") or os.cpu_count() or 1
    rows = [r for r in metrics if _num(r.get("data_wait_ms")) is not None and _num(r.get("step_time_ms"))]
    high = sum(r["data_wait_ms"] / (r["data_wait_ms"] + r["step_time_ms"]) >= DATA_WAIT_FRACTION_MAX for r in rows)
    steady = f"; in {high} of {len(rows)} log intervals" if rows else ""
    evidence = (
        f"{wait:.0%} of the measured time waited for the next batch (data_wait_fraction {wait:.3f}"
        f"{steady}; dataloader.num_workers={workers})"
    )
    sugg = []
    if workers < cores:
        n = min(cores, 4) if workers == 0 else min(cores, 2 * workers)
        sugg.append(
            Suggestion([f"dataloader.num_workers={n}"], f"load batches in {n} worker processes while the step runs")
        )
    pinned, on_device = TECHNIQUES["pinned_memory"], TECHNIQUES["on_device_data"]
    if pinned.why_not(job) is None and not pinned.is_on(config):
        sugg.append(Suggestion(pinned.overrides, "page-locked batches, asynchronous host-to-device copies"))
    if on_device.why_not(job) is None and not on_device.is_on(config):
        sugg.append(Suggestion(on_device.overrides, "the whole dataset as tensors on the device: no loader"))
    if not sugg:
        sugg.append(
            Suggestion(
                [], "the loader already uses every core: make __getitem__ cheaper (decode once, cache, smaller images)"
            )
        )
    return Finding("input-bound", evidence, wait, sugg)


def _launch_bound(config: dict[str, Any], idle: float, wait: float) -> Finding:
    """The host/launch-bound finding: the GPU idled between kernels for ``idle`` of a profiled window."""
    batch = _get(config, "dataloader.batch_size")
    sugg = []
    graphs = TECHNIQUES["compile_reduce_overhead"]
    if not graphs.is_on(config):
        sugg.append(Suggestion(graphs.overrides, "CUDA graphs: the whole step launched at once"))
    if batch:
        sugg.append(
            Suggestion(
                [f"dataloader.batch_size={2 * batch}"],
                "twice the work per launch (keep the LR rule: optimizer.lr_scaling)",
            )
        )
    return Finding(
        "host/launch-bound",
        f"the GPU idled {idle:.0%} of a profiled warm-up window between kernels "
        f"(data wait {wait:.0%}): it waits for the host to launch work",
        idle - wait,
        sugg,
    )


def _overhead(summary: dict[str, Any], job: Job, wait: float, metrics: list[dict[str, Any]]) -> Finding | None:
    """The sync/overhead-bound finding, or None: syncs per step, logging's share, arithmetic per second."""
    config = job.cfg
    log_every = int(_get(config, "trainer.log_every", 50) or 50)
    syncs = _num(summary.get("host_syncs_per_step"))
    if syncs is None and metrics and summary.get("steps"):  # an older summary: count the loss reads
        syncs = sum("loss" in r for r in metrics) / summary["steps"]
    log_share = _num(summary.get("log_time_fraction"))
    evidence, score = [], 0.0
    if syncs is not None and syncs >= SYNCS_PER_STEP_MAX:
        evidence.append(
            f"{syncs:g} host-device sync(s) per step (trainer.log_every={log_every}"
            + (", trainer.on_nonfinite=skip" if _get(config, "trainer.on_nonfinite") == "skip" else "")
            + ")"
        )
        score = max(score, 0.05)
    if log_share is not None and log_share >= LOG_TIME_FRACTION_MAX:
        evidence.append(f"logging took {log_share:.0%} of the measured time")
        score = max(score, log_share)
    threads = ((summary.get("machine_load") or {}).get("threads")) or 1
    flops, step_ms = _num(summary.get("flops_per_sample")), _num(summary.get("step_time_ms_median"))
    batch = summary.get("global_batch_size")
    if not job.cuda and flops and step_ms and batch:  # a CPU's arithmetic rate
        rate = flops * batch / (step_ms / 1e3)  # FLOP/s while computing (data wait excluded)
        floor = CPU_FLOPS_PER_THREAD_MIN * threads
        if rate < floor:
            evidence.append(
                f"a {step_ms:.3g} ms step computes only {rate / 1e9:.2g} GFLOP/s on {threads} "
                f"thread(s) (< {floor / 1e9:g}): fixed per-step costs (Python, op dispatch, the "
                f"optimizer's per-parameter work) dominate"
            )
            score = max(score, (1 - wait) * (1 - rate / floor))
    if not evidence:
        return None
    sugg = []
    if (syncs is not None and syncs >= SYNCS_PER_STEP_MAX) or (log_share or 0.0) >= LOG_TIME_FRACTION_MAX:
        if TECHNIQUES["fewer_syncs"].why_not(job, candidate=True) is None:
            sugg.append(
                Suggestion(TECHNIQUES["fewer_syncs"].overrides, "read the loss (a sync) and log every 50 steps")
            )
        if _get(config, "trainer.on_nonfinite") == "skip":
            sugg.append(Suggestion(["trainer.on_nonfinite=stop"], "no per-step gradient check (a sync per step)"))
    micro = _get(config, "dataloader.batch_size")
    if micro:
        sugg.append(
            Suggestion(
                [f"dataloader.batch_size={2 * micro}"],
                "per-step costs paid once per twice the samples (keep the LR rule: optimizer.lr_scaling)",
            )
        )
    graphs, compiled = TECHNIQUES["compile_reduce_overhead"], TECHNIQUES["compile"]
    if graphs.why_not(job) is None and not graphs.is_on(config):
        sugg.append(Suggestion(graphs.overrides, "one compiled graph, launched as a CUDA graph"))
    elif graphs.why_not(job) and compiled.why_not(job, candidate=True) is None and not compiled.is_on(config):
        sugg.append(Suggestion(compiled.overrides, "fused kernels, fewer Python-level ops (compiling takes time)"))
    return Finding("sync/overhead-bound", "; ".join(evidence), score, sugg)


def _ema_cost(summary: dict[str, Any], config: dict[str, Any]) -> Finding | None:
    """The EMA update's share of the step (``ema_update_ms``, timed at build), when above ``EMA_STEP_FRACTION_MAX``."""
    update_ms, step_ms = _num(summary.get("ema_update_ms")), _num(summary.get("step_time_ms_median"))
    decay, every = _get(config, "trainer.ema_decay"), int(_get(config, "trainer.ema_every", 1) or 1)
    if not update_ms or not step_ms or not decay or update_ms / every / step_ms < EMA_STEP_FRACTION_MAX:
        return None
    share = update_ms / every / step_ms
    n = every * math.ceil(share / 0.01)  # about 1 % of the step
    return Finding(
        "sync/overhead-bound",
        f"the EMA of the weights takes {update_ms:.3g} ms every {every} step(s), "
        f"{share:.0%} of a {step_ms:.3g} ms step",
        share,
        [
            Suggestion(
                [f"trainer.ema_every={n}", f"trainer.ema_decay={decay ** (n / every):.6g}"],
                f"update the average every {n} steps with the decay that keeps its horizon",
            )
        ],
    )


def _gradient_spikes(config: dict[str, Any], metrics: list[dict[str, Any]]) -> Finding | None:
    """Log rows whose ``grad_norm`` exceeds ``GRAD_NORM_SPIKE`` x the median of the rows before them."""
    norms = [(r["step"], r["grad_norm"]) for r in metrics if _num(r.get("grad_norm")) is not None]
    spikes = []
    for i in range(5, len(norms)):
        before = sorted(n for _, n in norms[:i])
        median = before[len(before) // 2]
        if median > 0 and norms[i][1] > GRAD_NORM_SPIKE * median:
            spikes.append((norms[i][0], norms[i][1], median))
    if not spikes:
        return None
    step, norm, median = max(spikes, key=lambda s: s[1] / s[2])
    clip = _get(config, "optimizer.clip_grad_norm")
    sugg = (
        [Suggestion(["optimizer.clip_grad_norm=1.0"], "clip the global gradient norm (GPT-2/3, Llama: 1.0)")]
        if clip is None
        else []
    )
    lr = _get(config, "optimizer.lr")
    if lr:
        sugg.append(Suggestion([f"optimizer.lr={lr / 2:g}"], "a smaller step size"))
    return Finding(
        "gradient spikes",
        f"{len(spikes)} log row(s) with a gradient norm above {GRAD_NORM_SPIKE:g}x the "
        f"median before it (worst: {norm:.3g} at step {step}, median {median:.3g}); "
        "not a speed problem, a stability one",
        0.0,
        sugg,
    )


def _memory_bound(job: Job, peak: float, limit: float) -> Finding:
    config, sugg = job.cfg, []
    if TECHNIQUES["bf16"].why_not(job, candidate=True) is None:
        sugg.append(Suggestion(TECHNIQUES["bf16"].overrides, "bf16 activations: about half the activation memory"))
    checkpointing = TECHNIQUES["activation_checkpointing"]
    if not checkpointing.is_on(config):
        sugg.append(Suggestion(checkpointing.overrides, "recompute activations in backward (~1 extra forward)"))
    micro, accumulate = _get(config, "dataloader.batch_size"), _get(config, "memory.accumulate_steps", 1) or 1
    if micro and micro >= 2:
        sugg.append(
            Suggestion(
                [f"dataloader.batch_size={micro // 2}", f"memory.accumulate_steps={2 * accumulate}"],
                "half the micro-batch, the same global batch",
            )
        )
    what = "the GPU's memory" if job.cuda else "the machine's memory (peak RSS)"
    return Finding(
        "memory-bound",
        f"peak memory {peak:,.0f} MiB is {peak / limit:.0%} of {what} ({limit:,.0f} MiB)",
        peak / limit - MEMORY_FRACTION_MAX,
        sugg,
    )
