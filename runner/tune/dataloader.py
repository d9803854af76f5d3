"""``python -m runner.tune dataloader``: num_workers x pin_memory x prefetch_factor of the run's DataLoader,
each measured on the loader alone and in a short training run; the fewest workers within
``tune.tolerance`` of the best samples/s is recommended.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from runner.errors import ConfigError
from runner.techniques import TECHNIQUES, Job
from runner.tune.harness import Tuner, fmt, measure_config, pyplot, say, trial_steps, with_overrides

#: what identifies one configuration of the grid (a row of the table)
SETTINGS = ("num_workers", "pin_memory", "prefetch_factor")


def default_grid(env, t: DictConfig) -> tuple[list[int], list[bool], list[int]]:
    """``(workers, pin_memory, prefetch_factors)``: ``tune.*`` where set; else workers 0, 1, 2, 4, ... up to
    the CPU count, pinning and prefetch factors 2 and 4 compared on CUDA only (pinning acts only there)."""
    cpus = os.cpu_count() or 1
    workers = list(t.workers) if t.workers is not None else sorted({0, 1, *(2**k for k in range(1, 8) if 2**k <= cpus)})
    pinning = TECHNIQUES["pinned_memory"].why_not(Job.of(None, env.device)) is None  # the table: on CUDA only
    pins = list(t.pin_memory) if t.pin_memory is not None else ([False, True] if pinning else [False])
    prefetch = list(t.prefetch_factors) if t.prefetch_factors is not None else ([2, 4] if pinning else [2])
    return workers, pins, prefetch


def tune_dataloader(cfg: DictConfig, env, job_dir: Path) -> dict[str, Any]:
    """Each ``(num_workers, pin_memory, prefetch_factor)`` of the grid (``default_grid``; the prefetch factor
    only with workers), measured twice with the run's own loader: alone (batches/s drawing
    ``tune.loader_batches`` batches) and in ``tune.measure_steps`` training steps (samples/s and the
    engine's data-wait fraction). Recommends the fewest workers whose samples/s is within ``tune.tolerance``
    of the best (the fastest such configuration): extra workers cost CPU cores and memory. The knobs are
    those of PyTorch's performance tuning guide ("Enable async data loading and augmentation",
    https://pytorch.org/tutorials/recipes/recipes/tuning_guide.html).

    Raises:
        ConfigError: ``dataloader.on_device=true`` (no DataLoader to tune); no configuration could be
            measured (out of memory).
    """
    if cfg.dataloader.on_device:
        raise ConfigError(
            "dataloader.on_device=true keeps the data on the device: there is no DataLoader to tune; "
            "drop dataloader=device (or dataloader.on_device=true) to tune the host loader"
        )
    t = cfg.tune
    workers, pins, prefetch = default_grid(env, t)
    grid = [(w, pin, pf if w > 0 else None) for w in workers for pin in pins for pf in (prefetch if w > 0 else [0])]
    rows = []
    for w, pin, pf in dict.fromkeys(grid):
        row = {"num_workers": w, "pin_memory": pin, "prefetch_factor": pf}
        row |= measure_config(
            with_overrides(cfg, dataloader__num_workers=w, dataloader__pin_memory=pin, dataloader__prefetch_factor=pf),
            env,
            job_dir,
            t,
            t.loader_batches,
        )
        rows.append(row)
        say(
            env,
            f"num_workers={w} pin_memory={pin} prefetch_factor={pf}: loader "
            f"{fmt(row['loader_batches_per_sec'])} batches/s, training {fmt(row['samples_per_sec'])} "
            f"samples/s, data wait {fmt(row['data_wait_fraction'], '.1%')}",
        )
    measured = [r for r in rows if r["status"] == "ok"]
    if not measured:
        raise ConfigError("no DataLoader configuration could be measured (out of memory); lower dataloader.batch_size")
    best = max(r["samples_per_sec"] for r in measured)
    close = [r for r in measured if r["samples_per_sec"] >= (1 - t.tolerance) * best]
    fewest = min(r["num_workers"] for r in close)
    pick = max((r for r in close if r["num_workers"] == fewest), key=lambda r: r["samples_per_sec"])
    override = f"dataloader.num_workers={pick['num_workers']} dataloader.pin_memory={str(pick['pin_memory']).lower()}"
    if pick["num_workers"] > 0:
        override += f" dataloader.prefetch_factor={pick['prefetch_factor']}"
    notes = [
        f"the fewest workers within {t.tolerance:.0%} of the best samples/s ({best:,.1f})",
        f"loader alone: {t.loader_batches} batches after {t.warmup_steps} left out; training: {trial_steps(t)} "
        f"of the run's own loop (batch {cfg.dataloader.batch_size})",
    ]
    if why := TECHNIQUES["pinned_memory"].why_not(Job.of(None, env.device)):
        notes.append(f"pin_memory does nothing here: {why}")
    return {
        "recommended": {k: pick[k] for k in (*SETTINGS, "samples_per_sec")},
        "override": override,
        "rows": rows,
        "notes": notes,
    }


def is_pick(row: dict, rec: dict) -> bool:
    """The recommended configuration's row."""
    return all(row[k] == rec[k] for k in SETTINGS)


def plot(result: dict[str, Any]):
    """Per configuration: training samples/s (left, the pick green) and loader-alone batches/s (right)."""
    plt = pyplot()
    rows, rec = result["rows"], result["recommended"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 0.35 * len(rows) + 2), sharey=True)
    labels = [
        f"w={r['num_workers']} pin={'y' if r['pin_memory'] else 'n'}"
        + (f" pf={r['prefetch_factor']}" if r["num_workers"] else "")
        for r in rows
    ]
    y = range(len(rows))
    colors = ["tab:green" if is_pick(r, rec) else "tab:blue" for r in rows]
    left.barh(y, [r["samples_per_sec"] or 0 for r in rows], color=colors)
    left.set_xlabel("training samples/s (green: recommended)")
    left.set_yticks(list(y), labels, fontsize=8)
    right.barh(y, [r["loader_batches_per_sec"] or 0 for r in rows], color="0.6")
    right.set_xlabel("loader alone: batches/s")
    for ax in (left, right):
        ax.grid(alpha=0.3, axis="x")
    return fig


TUNER = Tuner(
    name="dataloader",
    help="num_workers x pin_memory x prefetch_factor on the loader alone and in a short training run;\n"
    "recommend the fewest workers within tune.tolerance of the best samples/s",
    tune=tune_dataloader,
    columns=[
        ("num_workers", "num_workers", ""),
        ("pin_memory", "pin_memory", ""),
        ("prefetch_factor", "prefetch_factor", ""),
        ("status", "status", ""),
        ("loader_batches_per_sec", "loader batches/s", ",.1f"),
        ("samples_per_sec", "samples/s", ",.1f"),
        ("data_wait_fraction", "data wait", ".1%"),
        ("step_time_ms_median", "step ms", ",.1f"),
    ],
    is_pick=is_pick,
    plot=plot,
)
