"""``python -m runner.tune batch_size``: the fastest micro-batch per rank that leaves a memory margin
(``tune_batch_size``: the search).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from runner.config import global_batch_size
from runner.errors import ConfigError
from runner.tune.harness import Tuner, fmt, measure_config, pyplot, say, trial_steps, with_overrides


def memory_budget_mb(env, fraction: float) -> tuple[float | None, str]:
    """``(limit in MiB, what it is)`` a trial's peak memory must stay under: ``fraction`` of
    ``runner.measure.hardware.memory_limit_mb`` (the GPU's memory on CUDA; on a CPU the host memory this process may
    use, shared by this node's processes: world size / nodes under torchrun). ``(None, why)`` where the
    machine's memory is unknown: then only an out-of-memory error stops the search."""
    from runner.measure import hardware

    total = hardware.memory_limit_mb(env.device)
    if env.device.type == "cuda":
        return fraction * total, f"{fraction:g} x {total:,.0f} MiB of GPU memory"
    if total is None:
        return None, "none: this machine's memory is unknown"
    per_node = max(1, env.world_size // max(1, env.nodes))
    share = f" / {per_node} processes" if per_node > 1 else ""
    return fraction * total / per_node, f"{fraction:g} x {total:,.0f} MiB of host RAM{share}"


def _lr_note(cfg: DictConfig, micro_batch: int, world_size: int) -> tuple[str, float]:
    """How ``optimizer.lr_scaling`` sets the LR at ``micro_batch`` (runner.techniques.optim.scaled_lr, technique 3)."""
    from runner.techniques import optim

    o = cfg.optimizer
    global_batch = global_batch_size(micro_batch, cfg.memory.accumulate_steps, world_size)
    lr = optim.scaled_lr(o, global_batch)
    if o.lr_scaling != "none":
        return (
            f"the LR follows: {lr:.4g} at global batch {global_batch} (optimizer.lr={o.lr:g} x "
            f"optimizer.lr_scaling={o.lr_scaling} from optimizer.base_batch_size={o.base_batch_size})"
        ), lr
    linear = optim.scaled_lr(OmegaConf.merge(o, {"lr_scaling": "linear"}), global_batch)
    return (
        f"the LR stays {o.lr:g} (optimizer.lr_scaling=none); add optimizer.lr_scaling=linear to scale it "
        f"with the batch ({linear:.4g} at global batch {global_batch}; Goyal et al. 2017)"
    ), lr


def tune_batch_size(cfg: DictConfig, env, job_dir: Path) -> dict[str, Any]:
    """The micro-batch size (per rank, samples) with the highest samples/s that stays within the memory margin.

    Sizes: ``tune.start_batch_size``, then doubling while each size fits (no out-of-memory error, peak
    memory <= ``memory_budget_mb``) and is faster than the last, up to ``tune.max_batch_size`` (and the
    per-rank training set); then up to ``tune.search_steps`` bisections between the last good size and the
    first bad or slower one (midpoints rounded down to a multiple of 8 from 64 up), a midpoint being good
    when it fits and beats the current lower end. Each size is a fresh ``measure_config`` (its own model,
    optimizer with the LR ``optimizer.lr_scaling`` gives it, loader). The recommendation is the fastest
    measured size that fits. The search follows PyTorch Lightning's ``BatchSizeFinder`` (``mode="binsearch"``:
    double until a failure, then bisect), with speed and a memory margin as well as the failure deciding.

    Raises:
        ConfigError: the smallest size already runs out of memory or over the limit.
    """
    t = cfg.tune
    limit, limit_text = memory_budget_mb(env, t.max_memory_fraction)
    rows: list[dict[str, Any]] = []

    def measure(size: int, phase: str) -> dict[str, Any]:
        row = {
            "batch_size": size,
            "global_batch_size": global_batch_size(size, cfg.memory.accumulate_steps, env.world_size),
            "phase": phase,
        }
        row |= measure_config(with_overrides(cfg, dataloader__batch_size=size), env, job_dir, t)
        peak = row["peak_memory_mb"]
        if row["status"] == "ok" and limit is not None and peak is not None and peak > limit:
            row["status"], row["note"] = "over_memory_limit", f"peak > {limit:,.0f} MiB"
        rows.append(row)
        say(
            env,
            f"batch_size {size}: {row['status']}, {fmt(row['samples_per_sec'])} samples/s, peak "
            f"{fmt(row['peak_memory_mb'], ',.0f')} MiB",
        )
        return row

    def fits(row) -> bool:
        return row["status"] == "ok"

    first = measure(t.start_batch_size, "grow")
    if not fits(first):
        why = (
            "ran out of memory"
            if first["status"] == "oom"
            else f"peaked at {first['peak_memory_mb']:,.0f} MiB, over the limit of {limit:,.0f} MiB ({limit_text})"
            if first["status"] == "over_memory_limit"
            else "measured no step"
        )
        raise ConfigError(
            f"the job does not fit at the smallest batch size tried, dataloader.batch_size="
            f"{t.start_batch_size}: it {why}. Lower tune.start_batch_size, raise "
            f"tune.max_memory_fraction, or save memory (precision=bf16, memory=checkpointing)"
        )
    stop = _search(first, t, measure, fits)
    best = max((r for r in rows if fits(r)), key=lambda r: r["samples_per_sec"])
    note, lr = _lr_note(cfg, best["batch_size"], env.world_size)
    limit_line = (
        f"memory limit: {limit:,.0f} MiB ({limit_text})" if limit is not None else f"memory limit: {limit_text}"
    )
    return {
        "recommended": {
            "batch_size": best["batch_size"],
            "samples_per_sec": best["samples_per_sec"],
            "peak_memory_mb": best["peak_memory_mb"],
            "lr": lr,
        },
        "override": f"dataloader.batch_size={best['batch_size']}",
        "rows": rows,
        "memory_limit_mb": limit,
        "notes": [
            f"{limit_line}; peak memory is "
            + (
                "torch.cuda.max_memory_allocated"
                if env.device.type == "cuda"
                else "the process's peak RSS during the steps (DataLoader workers not counted)"
            ),
            stop,
            note,
            f"each size: {trial_steps(t)} of the run's own loop",
        ],
    }


def _search(first: dict[str, Any], t: DictConfig, measure, fits) -> str:
    """Double from ``first`` (a size that fits) while each size fits and is faster than the last, up to the cap;
    then bisect between the last good and the first bad or slower size (``tune.search_steps``). ``measure(size,
    phase)`` measures and records a size. Returns why the doubling stopped."""
    cap = min(t.max_batch_size, max(first["train_samples"], t.start_batch_size))
    good, bad, stop = first, None, f"reached tune.max_batch_size={t.max_batch_size}"
    if cap < t.max_batch_size:
        stop = f"reached the per-rank training set ({first['train_samples']} samples)"
    size = t.start_batch_size
    while size * 2 <= cap:
        size *= 2
        row = measure(size, "grow")
        if not fits(row) or row["samples_per_sec"] <= good["samples_per_sec"]:
            bad = size
            stop = f"stopped growing at {size}: " + (
                "slower than " + str(good["batch_size"]) if fits(row) else row["status"].replace("_", " ")
            )
            break
        good = row
    for _ in range(t.search_steps if bad is not None else 0):
        lo, hi = good["batch_size"], bad
        mid = (lo + hi) // 2
        if lo >= 64:
            mid -= mid % 8
        if not lo < mid < hi:
            break
        row = measure(mid, "search")
        if fits(row) and row["samples_per_sec"] > good["samples_per_sec"]:
            good = row
        else:
            bad = mid
    return stop


def is_pick(row: dict, rec: dict) -> bool:
    """The recommended size's row (a size measured in both phases is marked where it fitted)."""
    return row["batch_size"] == rec["batch_size"] and row["status"] == "ok"


def plot(result: dict[str, Any]):
    """Samples/s (top) and peak memory (bottom, the limit dashed) against the micro-batch size (log 2)."""
    plt = pyplot()
    rows, rec = result["rows"], result["recommended"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    ok = sorted((r for r in rows if r["status"] == "ok"), key=lambda r: r["batch_size"])
    top.plot([r["batch_size"] for r in ok], [r["samples_per_sec"] for r in ok], marker="o")
    top.plot(
        [rec["batch_size"]],
        [rec["samples_per_sec"]],
        marker="*",
        markersize=16,
        color="tab:green",
        linestyle="none",
        label=f"recommended: {rec['batch_size']}",
    )
    top.set_ylabel("samples/s")
    top.legend(fontsize=8)
    measured = sorted((r for r in rows if r["peak_memory_mb"]), key=lambda r: r["batch_size"])
    bottom.plot([r["batch_size"] for r in measured], [r["peak_memory_mb"] for r in measured], marker="o")
    for r in rows:
        if r["status"] != "ok":
            bottom.axvline(r["batch_size"], color="tab:red", alpha=0.4, linestyle=":")
    limit, highest = result["memory_limit_mb"], max((r["peak_memory_mb"] for r in measured), default=0.0)
    if limit is None:
        bottom.set_title("memory limit unknown", fontsize=9)
    elif limit <= 3 * highest:  # drawn where it is near the figures; otherwise said in the title
        bottom.axhline(limit, color="tab:red", linestyle="--", label="memory limit")
        bottom.legend(fontsize=8)
    else:
        bottom.set_title(f"memory limit {limit:,.0f} MiB (off the scale)", fontsize=9)
    bottom.set_ylabel("peak memory (MiB)")
    bottom.set_xlabel("micro-batch size per rank (red dotted: out of memory or over the limit)")
    bottom.set_xscale("log", base=2)
    sizes = sorted({r["batch_size"] for r in rows})
    bottom.set_xticks(sizes, [str(v) for v in sizes], fontsize=7)
    bottom.minorticks_off()
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    return fig


TUNER = Tuner(
    name="batch_size",
    help="grow the micro-batch (powers of two, then a binary search); measure samples/s and peak memory;\n"
    "recommend the fastest size within tune.max_memory_fraction of the device's memory",
    tune=tune_batch_size,
    columns=[
        ("batch_size", "batch size", ""),
        ("global_batch_size", "global batch", ""),
        ("phase", "phase", ""),
        ("status", "status", ""),
        ("samples_per_sec", "samples/s", ",.1f"),
        ("tokens_per_sec", "tokens/s", ",.0f"),
        ("step_time_ms_median", "step ms", ",.1f"),
        ("data_wait_fraction", "data wait", ".1%"),
        ("peak_memory_mb", "peak MiB", ",.0f"),
        ("note", "note", ""),
    ],
    is_pick=is_pick,
    plot=plot,
)
