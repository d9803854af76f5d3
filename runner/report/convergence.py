"""The convergence ablation's report: what each configuration buys in time to target, over seeds.

A convergence sweep (``+experiment=convergence``) holds one job folder per configuration and seed
(``<variant>/s<seed>``); each ``Variant`` holds its seeds and its samples, throughput and time ratios to the
baseline with Holm's verdicts. The method and the columns: docs/ablation.md, "Samples to target and time to target",
"Time to accuracy"; the text and the files: runner/report/convergence_text.py.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from runner import techniques
from runner.compare import record as record_mod, stats
from runner.compare.convergence import MIN_SEEDS, Seed, TargetRatio, read_seed, samples_to_target, time_to_target
from runner.compare.stats import Interval
from runner.report.load import ReportError

#: The configuration every other one is compared with.
REFERENCE = "baseline"
#: The verdict of a row whose technique changes a step's cost when no throughput measurement was given.
NEEDS_THROUGHPUT = "needs a throughput measurement (--throughput SWEEP)"


@dataclass
class Variant:
    """One configuration of the sweep: its seeds, how it compares with the baseline, and its verdicts."""

    name: str
    technique: str | None
    step_cost: bool  # whether its technique can change a step's cost (runner.techniques.step_cost)
    seeds: list[Seed] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # job folders without summary.json, counted as not reaching it
    eval_samples: int | None = None  # trainer.eval_every x the global batch: the resolution of "when"
    config: dict[str, Any] = field(default_factory=dict)  # a seed's summary.json config
    samples: TargetRatio | None = None
    throughput: Interval | float | None = None
    time: TargetRatio | None = None
    samples_verdict: str = ""
    verdict: str = ""

    @property
    def reached(self) -> int:
        return sum(s.reached for s in self.seeds)


def is_convergence(sweep: Path) -> bool:
    """Whether ``sweep`` holds a convergence sweep: a job whose config says ``ablation.measure: convergence``."""
    for path in sorted(Path(sweep).glob("**/.hydra/config.yaml")):
        try:
            return OmegaConf.select(OmegaConf.load(path), "ablation.measure") == "convergence"
        except Exception:  # noqa: BLE001 - an unreadable job config: look at the next
            continue
    return False


def _censored(folder: Path, cfg: Any, siblings: list[dict[str, Any]]) -> Seed:
    """The seed of a job folder without summary.json: not reached, at its budget (``trainer.max_steps`` × the
    global batch, from a sibling seed's summary where one exists, else batch × accumulation steps).

    Raises:
        ReportError: the budget cannot be known (no ``trainer.max_steps``)."""
    try:
        steps = OmegaConf.select(cfg, "trainer.max_steps")
        batch = (
            siblings[0]["global_batch_size"]
            if siblings
            else (
                OmegaConf.select(cfg, "dataloader.batch_size") * (OmegaConf.select(cfg, "memory.accumulate_steps") or 1)
            )
        )
    except Exception as e:  # noqa: BLE001 - an interpolation that does not resolve outside the job
        raise ReportError(
            f"{folder}: no summary.json, and its budget cannot be read from .hydra/config.yaml ({e}); "
            f"rerun that seed (a failed seed is counted as not reaching the target, not dropped)"
        ) from e
    if not steps:
        raise ReportError(
            f"{folder}: no summary.json and no trainer.max_steps, so the budget it did not reach the "
            f"target within is unknown; rerun that seed (with a step limit)"
        )
    return Seed(float(steps * batch), False, OmegaConf.select(cfg, "trainer.seed"), None, str(folder))


def load_variants(sweep: Path) -> dict[str, Variant]:
    """Every configuration of the convergence sweep in ``sweep`` with its seeds, by name.

    Raises:
        ReportError: no job folders, a job naming no ``ablation.variant``, a summary without the target figures, or
            one seed twice in a configuration.
    """
    folders = sorted(p.parent.parent for p in Path(sweep).glob("**/.hydra/config.yaml"))
    if not folders:
        raise ReportError(
            f"{sweep} holds no job folder (<variant>/s<seed>/.hydra); pass the sweep folder of "
            f"`python -m runner -m +experiment=convergence` (outputs/convergence/<date>/<time>)"
        )
    variants: dict[str, Variant] = {}
    missing: list[tuple[Path, Any, Variant]] = []
    for folder in folders:
        cfg = OmegaConf.load(folder / ".hydra" / "config.yaml")
        name = OmegaConf.select(cfg, "ablation.variant")
        if name is None:
            raise ReportError(f"{folder} names no ablation.variant: not a job of +experiment=convergence")
        technique = OmegaConf.select(cfg, "ablation.technique")
        v = variants.setdefault(name, Variant(name, technique, techniques.step_cost(technique)))
        if not (folder / "summary.json").is_file():
            missing.append((folder, cfg, v))
            continue
        try:
            v.seeds.append(read_seed(folder))
        except ValueError as e:
            raise ReportError(str(e)) from e
        summary = json.loads((folder / "summary.json").read_text())
        v.config = v.config or summary.get("config") or {}
        every = (v.config.get("trainer") or {}).get("eval_every")
        v.eval_samples = v.eval_samples or (every * summary["global_batch_size"] if every else None)
    for folder, cfg, v in missing:
        siblings = [json.loads(Path(s.source).read_text()) for s in v.seeds[:1] if s.source]
        v.seeds.append(_censored(folder, cfg, siblings))
        v.failed.append(str(folder.relative_to(sweep)))
    for v in variants.values():
        known = [s.seed for s in v.seeds if s.seed is not None]
        if len(known) != len(set(known)):
            raise ReportError(
                f"{v.name}: seed(s) {sorted({s for s in known if known.count(s) > 1})} appear more "
                f"than once in {sweep}: pass one sweep folder (each seed counts once)"
            )
    return variants


def _variant_of(name: str) -> str:
    return name.split("/")[0]  # an ablation job folder is <variant>/r<process>


def throughput_intervals(sweep: Path) -> dict[str, Interval | None]:
    """Variant -> its samples/s ÷ the baseline's (an ``Interval``; None below 2 pairs or processes), from the
    interleaved record of an ablation sweep (``+experiment=ablation``) in ``sweep``; a leave-one-out variant
    through the fast preset (``record.chained``).

    Raises:
        ReportError: no interleave.json there, or a reference that is not the baseline.
    """
    try:
        record = record_mod.load(Path(sweep))
    except ValueError as e:
        raise ReportError(str(e)) from e
    if record is None:
        raise ReportError(
            f"--throughput {sweep}: no interleave.json; pass the sweep folder of an interleaved "
            f"ablation of the same variants (python -m runner -m +experiment=ablation "
            f"ablation/variant=baseline,...)"
        )
    reference = record["reference"]
    if _variant_of(reference) != REFERENCE:
        raise ReportError(
            f"--throughput {sweep}: its reference is {reference}, not the baseline; include "
            f"`baseline` in its ablation/variant=..."
        )
    comparisons = record_mod.compare(record)
    out: dict[str, Interval | None] = {}
    for name, job in record["jobs"].items():
        variant = _variant_of(name)
        if (job.get("config") or name) != name or variant == REFERENCE or job.get("reference") is None:
            continue  # a further process of a configuration, the baseline's copy (A'), the reference
        out[variant] = (
            comparisons.get(name) if job["reference"] == reference else record_mod.chained(record, name, reference)
        )
    return out


#: The keys that make two sweeps the same job, for ``--throughput``: the model, the data and the baseline's batch.
SAME_JOB = ("model._target_", "data.name", "optimizer.base_batch_size", "memory.accumulate_steps")


def check_same_job(config: dict[str, Any], throughput: Path) -> None:
    """Refuse a throughput sweep of another job: its baseline's summary config differs from ``config`` (the
    convergence baseline's) on a ``SAME_JOB`` key. Nothing is checked where its baseline left no summary.

    Raises:
        ReportError: naming the keys that differ."""
    path = Path(throughput) / REFERENCE / "r0" / "summary.json"
    if not path.is_file() or not config:
        return
    theirs = json.loads(path.read_text()).get("config") or {}
    differ = [
        f"{k}: {techniques.select(config, k)} here, {techniques.select(theirs, k)} there"
        for k in SAME_JOB
        if techniques.select(config, k) != techniques.select(theirs, k)
    ]
    if differ:
        raise ReportError(
            f"--throughput {throughput} measured another job ({'; '.join(differ)}); measure the "
            f"variants with this sweep's model, data and batch"
        )


def _without_time(v: Variant, base: Variant, measured: dict[str, Interval | None] | None) -> str:
    """Why a row has no time-to-target ratio."""
    if not any(s.reached for s in (*v.seeds, *base.seeds)):
        return "no seed reached the target"
    if v.samples is None:
        return f"no interval (fewer than {MIN_SEEDS} seeds a side)"
    if measured is None:
        return NEEDS_THROUGHPUT
    if v.name not in measured:
        return f"not in the throughput sweep: measure it there (ablation/variant={REFERENCE},{v.name})"
    return "no throughput interval (fewer than 2 pairs or processes)"


def _throughput(v: Variant, measured: dict[str, Interval | None] | None) -> Interval | float | None:
    if not v.step_cost:
        return 1.0  # the same work per step: the ratio is exactly 1
    return None if measured is None else measured.get(v.name)


def build_variants(sweep: Path, throughput: Path | None = None, confidence: float = 0.95) -> list[Variant]:
    """The report's rows: the baseline first, then every other configuration compared with it, with Holm's verdicts
    over the time-to-target ratios and, separately, over the samples ratios.

    Raises:
        ReportError: see ``load_variants`` and ``throughput_intervals``; no baseline; seeds run to different
            targets.
    """
    variants = load_variants(Path(sweep))
    if REFERENCE not in variants:
        raise ReportError(
            f"no baseline among the configurations {sorted(variants)}; every ratio is measured "
            f"against it: include `baseline` in ablation/variant=..."
        )
    base = variants.pop(REFERENCE)
    base.samples_verdict = base.verdict = "reference"
    measured = None
    if throughput is not None:
        check_same_job(base.config, Path(throughput))
        measured = throughput_intervals(Path(throughput))
    rows = [variants[n] for n in sorted(variants)]
    for v in rows:
        try:
            v.samples = samples_to_target(v.seeds, base.seeds, confidence)
            v.throughput = _throughput(v, measured)
            v.time = time_to_target(v.seeds, base.seeds, v.throughput, confidence)
        except ValueError as e:
            raise ReportError(f"{v.name}: {e}") from e
    for v, said in zip(rows, stats.verdicts([v.samples for v in rows], confidence)):
        v.samples_verdict = said or _without_time(v, base, {})
    for v, said in zip(rows, stats.verdicts([v.time for v in rows], confidence)):
        v.verdict = said or _without_time(v, base, measured)
    return [base, *rows]


def median_samples(seeds: list[Seed]) -> str:
    """The median samples to target over ``seeds``, a seed that did not reach it counting as later than every one
    that did: ``"61,440"``, or ``"> 120,000"`` when half or more did not reach it."""
    if not seeds:
        return "–"
    values = sorted(s.value if s.reached else math.inf for s in seeds)
    n = len(values)
    middle = values[(n - 1) // 2 : n // 2 + 1]
    if math.isinf(middle[-1]):
        return f"> {min(s.value for s in seeds if not s.reached):,.0f}"
    return f"{sum(middle) / len(middle):,.0f}"
