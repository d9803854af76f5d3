"""A finished job's folder as the doctor reads it, the command that reruns it with suggestions, and the text."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.doctor.diagnosis import Finding, _num, diagnose
from runner.errors import ConfigError


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
        raise ConfigError(
            f"{folder} is not a folder; pass a job folder of `python -m runner` "
            f"(outputs/<date>/<time>, or outputs/multirun/<date>/<time>/<n>)"
        )
    path = folder / "summary.json"
    if not path.is_file():
        raise ConfigError(
            f"{folder} has no summary.json: the run failed, was stopped or is still running (a "
            f"summary is written only at the end of a finished run); pass a finished job's folder"
        )
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
                    f"{s.schema}://{s.path}" for s in hydra.runtime.config_sources if s.provider == "command-line"
                ]
        except Exception as e:  # noqa: BLE001 - OmegaConf/YAML errors of a damaged file: one message
            raise ConfigError(
                f"{hydra_dir} cannot be read ({type(e).__name__}: {e}); the diagnosis needs the "
                f"job's .hydra folder as Hydra wrote it"
            ) from e
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


def launcher(summary: dict[str, Any]) -> list[str]:
    """How the job's processes were started, from ``summary.json`` ``world_size`` and ``nodes``: ``python``
    for one process, ``torchrun --nproc-per-node=N`` for N on one node, ``torchrun --nnodes=M
    --nproc-per-node=N/M`` across M nodes (add the rendezvous options the job used)."""
    world = int(_num(summary.get("world_size")) or 1)
    nodes = max(1, int(_num(summary.get("nodes")) or 1))
    if world <= 1:
        return ["python"]
    if nodes > 1:
        return ["torchrun", f"--nnodes={nodes}", f"--nproc-per-node={max(1, world // nodes)}"]
    return ["torchrun", f"--nproc-per-node={world}"]


def command(job: Job, extra: list[str]) -> str:
    """The shell command of the job with ``extra`` overrides (quoted for a POSIX shell), started as the job
    was (``launcher``: ``torchrun --nproc-per-node=N -m runner ...`` for a job of N processes)."""
    config_dirs = [p.removeprefix("file://") for p in job.searchpath if p.startswith("file://")]
    prefix = [*launcher(job.summary), "-m", "runner"] + [a for d in config_dirs for a in ("--config-dir", d)]
    return shlex.join(prefix + merge_overrides(job.overrides, extra))


def render(findings: list[Finding], job: Job, warnings_shown: bool = False) -> str:
    """The diagnosis as text: one block per finding (category, evidence, one command per suggestion).
    ``warnings_shown``: the run's summary table just printed the machine-load warnings, so the
    untrustworthy finding points to them instead of repeating them."""
    s = job.summary
    figures = [
        f"samples/s {s['samples_per_sec']:,.4g}" if _num(s.get("samples_per_sec")) else None,
        f"step {s['step_time_ms_median']:.3g} ms" if _num(s.get("step_time_ms_median")) else None,
        f"data wait {s['data_wait_fraction']:.0%}" if _num(s.get("data_wait_fraction")) is not None else None,
        f"MFU {s['mfu']:.0%}" if _num(s.get("mfu")) is not None else None,
    ]
    shown = ", ".join(f for f in figures if f)
    lines = [f"speed doctor ({shown}):" if shown else "speed doctor:"]
    if not findings:
        lines.append(
            "  no bottleneck above the doctor's thresholds (runner/doctor/diagnosis.py); measure a switch "
            "with `python -m runner -m +experiment=ablation ...`"
        )
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
    lines.append(f"  or let the speed tuner find and verify the fastest combination: {tune_command(job)}")
    return "\n".join(lines)


def tune_command(job: Job) -> str:
    """``python -m runner.tune speed`` with the job's overrides (runner/tune/speed.py): one process, as the tuner
    measures; its pick applies to a distributed job too."""
    config_dirs = [p.removeprefix("file://") for p in job.searchpath if p.startswith("file://")]
    prefix = ["python", "-m", "runner.tune", "speed"] + [a for d in config_dirs for a in ("--config-dir", d)]
    return shlex.join(prefix + [o for o in job.overrides if not o.startswith(("distributed=", "hydra."))])


def report(folder: Path, warnings_shown: bool = False) -> str:
    """The diagnosis of the job in ``folder`` as printed text (``load_job`` + ``diagnose`` + ``render``)."""
    job = load_job(folder)
    return render(diagnose(job.summary, job.config, job.metrics), job, warnings_shown)
