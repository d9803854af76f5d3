"""``python -m runner.evaluate JOB [--weights final|ema|best] [--out FILE] [overrides]``: evaluate a finished job.

    python -m runner.evaluate outputs/<date>/<time>                               # the job's validation split, whole
    python -m runner.evaluate outputs/<date>/<time> --weights ema trainer.eval_max_batches=20
    python -m runner.evaluate outputs/<date>/<time> data=cifar10 data.root=/path/with/cifar

What is rebuilt, what is written and the limits: docs/checkpointing.md, "Evaluate and export a finished job".
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from runner import trust
from runner.errors import ConfigError
from runner.track.records import check_weights

#: ``--weights`` choice -> (file in the job folder, what writes it: the fix when it is missing).
WEIGHTS = {
    "final": ("model.safetensors", "checkpoint.at_end=true (the default) writes it after the last step"),
    "ema": (
        "model_ema.safetensors",
        "trainer.ema_decay=<decay> (e.g. 0.999) keeps a moving average of the weights and writes it at the end",
    ),
    "best": (
        "best/model.safetensors",
        "checkpoint.keep_best=true writes it after each evaluation that improves checkpoint.best_metric",
    ),
}


def weights_file(folder: Path, weights: str, cfg: DictConfig | None = None) -> Path:
    """The file of ``--weights`` ``weights`` in job ``folder`` (``WEIGHTS``).

    Raises:
        ConfigError: an unknown choice, or no such file (says which setting writes it, and which weights the
            folder has instead).
    """
    if weights not in WEIGHTS:
        raise ConfigError(
            f"--weights {weights}: use one of {', '.join(WEIGHTS)} "
            f"({', '.join(f'{k}: {v[0]}' for k, v in WEIGHTS.items())})"
        )
    name, writer = WEIGHTS[weights]
    path = folder / name
    if path.is_file():
        return path
    why = {
        "final": "the job did not finish (the final weights are written after its last step)",
        "ema": "the job kept no moving average of its weights",
        "best": "the job kept no best weights",
    }[weights]
    if weights == "final" and cfg is not None and OmegaConf.select(cfg, "checkpoint.at_end") is False:
        why = "the job ran with checkpoint.at_end=false, which writes no final weights"
    have = [k for k, (n, _) in WEIGHTS.items() if (folder / n).is_file()]
    other = f"; this folder has --weights {' / '.join(have)}" if have else "; this folder holds no weights file"
    raise ConfigError(f"{path} does not exist: {why}. {writer}: train the job with it{other}")


def _hydra_facts(folder: Path) -> tuple[dict[str, str], list[str]]:
    """The job's group choices (``data: synthetic``, ...; Hydra's own and nested groups left out) and the config
    search path its command added, from ``.hydra/hydra.yaml`` (empty when absent)."""
    path = folder / ".hydra" / "hydra.yaml"
    if not path.is_file():
        return {}, []
    try:
        hydra = OmegaConf.load(path).hydra
        choices = {
            str(g): str(o)
            for g, o in hydra.runtime.choices.items()
            if o is not None and "/" not in str(g) and g != "experiment"
        }  # runner's top-level groups
        cwd = Path(str(hydra.runtime.cwd))
        searchpath = []
        for entry in [str(p) for p in hydra.searchpath] + [
            f"{s.schema}://{s.path}" for s in hydra.runtime.config_sources if s.provider == "command-line"
        ]:
            scheme, _, where = entry.partition("://")
            if scheme == "file" and not Path(where).is_absolute():  # relative to the folder the job ran from
                entry = f"file://{cwd / where}"
            searchpath.append(entry)
    except Exception as e:  # noqa: BLE001 - a damaged YAML file fails in many ways: one message
        raise ConfigError(
            f"{path} cannot be read ({type(e).__name__}: {e}); it must be the file Hydra wrote for the job"
        ) from e
    return choices, searchpath


def job_config(
    folder: Path, overrides: list[str] | tuple[str, ...] = (), policy: trust.Policy | None = None
) -> DictConfig:
    """The job's config (``<folder>/.hydra/config.yaml``, resolved, then Hydra-style ``overrides``) over runner's
    conf/ composed with the job's group choices (docs/checkpointing.md, "What is rebuilt"); checked by
    ``runner.trust`` under ``policy`` first.

    Raises:
        ConfigError: no ``.hydra/config.yaml`` in ``folder`` (not a job folder), an unreadable config, a sweep
            (``a=1,2``), a group the job does not have (``+experiment=...``), an unknown key (with the close
            declared one) or a value the schema refuses; a target, resolver or search path ``policy`` refuses.
    """
    from runner import CONF_DIR

    folder = Path(folder)
    policy = policy or trust.Policy.make(folder=folder)
    saved, saved_path = _saved_config(folder, policy)
    choices, searchpath = _hydra_facts(folder)
    trust.check_searchpath(searchpath, policy, folder / ".hydra" / "hydra.yaml")
    groups = {p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "hydra"} | set(choices)
    switched, keys, policy = _parse_overrides(overrides, choices, groups, policy)
    cfg = _typed(saved, saved_path, choices, switched, searchpath)
    trust.check_interpolations(cfg, policy, saved_path)  # the search path's configs too, before the user's keys
    _apply(cfg, keys)
    try:
        OmegaConf.resolve(cfg)
    except Exception as e:  # noqa: BLE001 - interpolation errors: one message
        raise ConfigError(f"the job's config with {' '.join(overrides)} cannot be resolved: {e}") from e
    trust.check_config(cfg, policy, saved_path)  # every target of what is built, before any is imported
    return cfg


def _saved_config(folder: Path, policy: trust.Policy) -> tuple[DictConfig, Path]:
    """``<folder>/.hydra/config.yaml``, checked by ``runner.trust`` (the folder, the targets, then the
    interpolations) before it is resolved."""
    saved_path = folder / ".hydra" / "config.yaml"
    if not folder.is_dir():
        raise ConfigError(
            f"{folder} is not a folder; pass a finished job's folder of `python -m runner`, "
            f"outputs/<date>/<time> or outputs/multirun/<date>/<time>/<n>"
        )
    if not saved_path.is_file():
        raise ConfigError(
            f"{folder} is not a job folder of `python -m runner`: it has no .hydra/config.yaml (the "
            f"config a run saves); pass a finished job's folder, outputs/<date>/<time> or "
            f"outputs/multirun/<date>/<time>/<n>"
        )
    trust.check_package(folder, policy)
    try:
        saved = OmegaConf.load(saved_path)
    except Exception as e:  # noqa: BLE001 - YAML errors: one message
        raise ConfigError(
            f"{saved_path} cannot be read ({type(e).__name__}: {e}); it must be the config Hydra saved for the job"
        ) from e
    trust.moved(saved)  # a job folder from before the package's folders names the old paths of runner's objects
    trust.check_config(saved, policy, saved_path)  # before anything is resolved: the targets first, then how
    trust.check_interpolations(saved, policy, saved_path)
    try:
        OmegaConf.resolve(saved)
    except Exception as e:  # noqa: BLE001 - interpolation errors: one message
        raise ConfigError(
            f"{saved_path} cannot be read ({type(e).__name__}: {e}); it must be the config Hydra saved for the job"
        ) from e
    return saved, saved_path


def _parse_overrides(
    overrides, choices: dict[str, str], groups: set[str], policy: trust.Policy
) -> tuple[dict[str, str], list, trust.Policy]:
    """The overrides split into group switches (``data=cifar10``) and key overrides; a ``_target_`` the user names
    here is allowed (the returned policy)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as e:
        raise ConfigError(f"the overrides {' '.join(overrides)} cannot be parsed: {e}") from e
    switched: dict[str, str] = {}
    keys = []
    for o in parsed:
        if o.is_sweep_override():
            raise ConfigError(f"{o.input_line} is a sweep; evaluate one configuration at a time (one value per key)")
        group = o.key_or_group
        if group in choices and "." not in group and not o.is_delete():
            switched[group] = o.get_value_element_as_str()
        elif group.split("/")[0] in groups and "." not in group:
            raise ConfigError(
                f"{o.input_line}: the job has no {group} group to switch (its groups: "
                f"{', '.join(sorted(choices))}); set the keys you need instead (key=value)"
            )
        else:
            keys.append(o)
            if group.split(".")[-1] == "_target_" and not o.is_delete():
                policy = policy.naming([o.get_value_element_as_str()])  # the user named it: allowed
    return switched, keys, policy


def _typed(
    saved: DictConfig, saved_path: Path, choices: dict[str, str], switched: dict[str, str], searchpath: list[str]
) -> DictConfig:
    """The saved values laid over the config Hydra composes from runner's conf/ with the job's group choices (and
    the switched ones), so every node keeps its schema."""
    from omegaconf.errors import OmegaConfBaseException

    from runner.techniques import variants

    try:
        typed = variants.compose([f"{g}={o}" for g, o in {**choices, **switched}.items()], searchpath)
    except Exception as e:  # noqa: BLE001 - Hydra's compose errors come in several types: one message
        raise ConfigError(
            f"{' '.join(f'{g}={o}' for g, o in switched.items()) or 'the job'}'s groups do not "
            f"compose with runner's configs: {e}"
        ) from e
    try:
        cfg = OmegaConf.merge(typed, {k: v for k, v in saved.items() if k not in switched})
    except OmegaConfBaseException as e:
        raise ConfigError(
            f"{saved_path} does not fit runner's config schema for the job's groups "
            f"({', '.join(f'{g}={o}' for g, o in choices.items())}): {e}. It was written by another "
            f"version of runner (evaluate it with that version), or .hydra/hydra.yaml is missing or "
            f"edited"
        ) from e
    OmegaConf.set_struct(cfg, True)
    return cfg


def _apply(cfg: DictConfig, keys: list) -> None:
    """The key overrides applied as Hydra applies them (``+key=`` adds, ``~key`` deletes)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl  # Hydra's own override application
    from hydra.errors import HydraException

    from runner.engine.validate import misspelt_override

    for o in keys:
        try:
            ConfigLoaderImpl._apply_overrides_to_config([o], cfg)
        except HydraException as e:
            message = misspelt_override(e)
            cause = e.__cause__ if e.__cause__ is not None else e
            raise ConfigError(
                message or f"{o.input_line} does not apply to the job's config: {str(cause).splitlines()[0]}"
            ) from e


@dataclass
class Rebuilt:
    """A finished job rebuilt for evaluation or export: the config, the one-process ``Env``, the parts, the
    weights file loaded into the plain (unwrapped, uncompiled) model, which is in eval mode."""

    folder: Path
    cfg: DictConfig
    env: Any  # runner.distributed.Env, one process
    task: Any
    data: Any  # runner.data.Data
    model: Any  # torch.nn.Module
    amp: Any  # runner.techniques.precision.Precision
    weights: str
    weights_path: Path
    overrides: list[str]
    weights_verified: bool = False  # its SHA-256 matched summary.json's (False: the run recorded none)


def rebuild(
    folder: Path,
    weights: str = "final",
    overrides: list[str] | tuple[str, ...] = (),
    policy: trust.Policy | None = None,
) -> Rebuilt:
    """Rebuild job ``folder`` as the engine builds it (no compile or wrapper; ``compress=qat``'s fake-quantized
    layers) on ``trainer.device`` and load ``--weights``; ``policy``: what the job's config may name (``runner.trust``).

    Raises:
        ConfigError: from ``job_config`` and ``weights_file``; a weights file whose SHA-256 differs from the one
            the run recorded in ``summary.json`` (``runner.track.records.check_weights``: modified or corrupted); any
            builder's bad input (a dataset that is missing, a model that does not take the data); a weights file
            that cannot be read (corrupt, truncated) or does not fit the model (another model's, or overrides that
            changed ``model.*``).
    """
    folder = Path(folder)
    overrides = list(overrides)
    defaults = (
        []
        if any(o.lstrip("+~").startswith("trainer.eval_max_batches") for o in overrides)
        else ["trainer.eval_max_batches=null"]
    )
    cfg = job_config(folder, defaults + overrides, policy)  # bad input stops here, before torch is imported
    path = weights_file(folder, weights, cfg)
    verified = check_weights(folder, path)  # against summary.json's SHA-256: a modified file is refused
    if not verified:  # a run that did not finish, or one from before runner kept checksums
        print(
            f"warning: {path} has no SHA-256 in {Path(folder) / 'summary.json'}: it is loaded unchecked",
            file=sys.stderr,
            flush=True,
        )

    import numpy as np
    import torch

    from runner import data as data_mod, distributed, models, task as task_mod
    from runner.engine.validate import validate
    from runner.techniques import compress, precision, prepare

    validate(cfg)
    env = distributed.Env(
        rank=0, local_rank=0, world_size=1, nodes=1, device=distributed.pick_device(cfg.trainer.device)
    )
    # runner.engine.build.seed_everything's three seeds (a data function may draw its split), without its imports
    random.seed(cfg.trainer.seed)
    np.random.seed(cfg.trainer.seed)
    torch.manual_seed(cfg.trainer.seed)
    task = task_mod.build(cfg.task)
    skipped = task.skipped(cfg)
    channels_last = cfg.channels_last and "channels_last" not in skipped
    data = data_mod.build(
        cfg.data,
        cfg.dataloader,
        env,
        seed=cfg.trainer.seed,
        memory_format=torch.channels_last if channels_last else torch.contiguous_format,
        task=task,
    )
    _check_vocabulary(folder, data.vocab, cfg)
    model = models.build(cfg.model, task.model_kwargs(data), data.in_channels, example=data.item)
    task.check(model, data)
    try:
        models.load_weights(model, path)
    except RuntimeError as e:
        if "state_dict" not in str(e):
            raise ConfigError(
                f"cannot read {path} ({type(e).__name__}: {str(e).splitlines()[0][:300]}): the file is "
                f"corrupt or truncated; {WEIGHTS[weights][1]}, so train the job again"
            ) from e
        raise ConfigError(
            f"{path} does not fit the job's model {cfg.model._target_} "
            f"({str(e).splitlines()[0][:300]} ...): the file holds another model's weights, or the "
            f"overrides changed the model's shape (model.*, or data with other channels, classes or "
            f"vocabulary than the job's); evaluate with the job's model and data of the same kind"
        ) from e
    except Exception as e:  # noqa: BLE001 - safetensors' reader raises its own SafetensorError (and OSError)
        raise ConfigError(
            f"cannot read {path} as safetensors weights ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:300] if str(e) else ''}): the file is corrupt or truncated; "
            f"{WEIGHTS[weights][1]}, so train the job again"
        ) from e
    model = model.to(env.device)
    compress.for_evaluation(model, cfg)  # compress=qat: its fake-quantized layers, as it trained
    if channels_last:
        prepare.apply_channels_last(model)
    model.eval()
    amp = precision.build(cfg.precision, env.device)
    return Rebuilt(folder, cfg, env, task, data, model, amp, weights, path, overrides, verified)


def _check_vocabulary(folder: Path, vocab: list[str] | None, cfg: DictConfig) -> None:
    """Token data: the text's vocabulary must be the job's (``vocab.json``).

    Raises:
        ConfigError: naming ``data.path``, the job's ``vocab.json`` and the fix.
    """
    import json

    saved_path = folder / "vocab.json"
    if vocab is None or not saved_path.is_file():
        return
    try:
        saved = json.loads(saved_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if list(saved) != list(vocab):
        raise ConfigError(
            f"data.path={cfg.data.path} has a vocabulary of {len(vocab)} characters that differs from "
            f"the {len(saved)} of the job's {saved_path}: its token ids would mean other characters; "
            f"evaluate on the text the job trained on, or on text with exactly its characters"
        )


def evaluate(
    folder: Path,
    weights: str = "final",
    overrides: list[str] | tuple[str, ...] = (),
    out: Path | None = None,
    policy: trust.Policy | None = None,
) -> dict[str, Any]:
    """Evaluate the job in ``folder`` with ``weights`` on its validation split (or the overrides' data) and write
    the record atomically to ``out`` (default ``<folder>/eval-<weights>.json``); returns it (its fields:
    docs/checkpointing.md, "Evaluate and export a finished job"; ``eval_time_s`` in seconds).

    Raises:
        ConfigError: see ``rebuild``; ``out`` in a folder that cannot be made or written (checked before the
            evaluation), or the record that cannot be written.
    """
    if out is not None:
        _writable(Path(out))  # before the evaluation: a place that cannot hold the record fails first
    r = rebuild(folder, weights, overrides, policy)
    import torch

    from runner.track import write_json_atomic

    t = r.cfg.trainer
    started = time.perf_counter()
    metrics = r.task.evaluate(r.model, r.data.eval, r.amp.autocast, t.eval_max_batches, r.env)
    elapsed = time.perf_counter() - started
    batches = len(r.data.eval) if t.eval_max_batches is None else min(len(r.data.eval), t.eval_max_batches)
    record = {
        "job": str(r.folder),
        "weights": weights,
        "weights_file": str(r.weights_path.relative_to(r.folder)),
        "weights_verified": r.weights_verified,
        "overrides": r.overrides,
        "metrics": metrics,
        "data": OmegaConf.to_container(r.cfg.data, resolve=True),
        "batch_size": r.cfg.dataloader.batch_size,
        "eval_max_batches": t.eval_max_batches,
        "batches": batches,
        "device": str(r.env.device),
        "precision": r.cfg.precision.name,
        "eval_time_s": elapsed,
        "torch_version": torch.__version__,
    }
    path = Path(out) if out is not None else r.folder / f"eval-{weights}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, record)
    except OSError as e:  # a read-only job folder, a full disk
        raise ConfigError(
            f"cannot write {path} ({e.strerror or e}); pass --out <a file in a folder you can write>"
        ) from e
    record["path"] = str(path)
    return record


def _writable(out: Path) -> None:
    """``--out``: its folder exists or can be made, and takes a file (probed with a temporary file, removed).

    Raises:
        ConfigError: naming ``--out``, the folder and why (``/proc/x``: no such folder can be made).
    """
    import tempfile

    if out.is_dir():
        raise ConfigError(f"--out {out} is a folder; give the record's file name, e.g. --out {out / 'eval.json'}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out.parent):
            pass
    except OSError as e:
        raise ConfigError(
            f"--out {out}: cannot write into {out.parent} ({e.strerror or e}); give a file in a folder you can write"
        ) from e


def render(record: dict[str, Any]) -> str:
    """The record as console lines: what was evaluated, one metric per line, where it was written."""
    data = record["data"]
    where = data.get("path") or data.get("root")
    lines = [
        f"evaluated {record['job']} (--weights {record['weights']}: {record['weights_file']}) on "
        f"data={data.get('name')}"
        + (f" ({where})" if where and data.get("name") != "synthetic" else "")
        + f", validation split: {record['batches']} batches of {record['batch_size']}"
        + ("" if record["eval_max_batches"] is None else f" (trainer.eval_max_batches={record['eval_max_batches']})")
        + f", {record['device']}, precision={record['precision']}"
    ]
    width = max(len(k) for k in record["metrics"])
    lines += [f"  {k:<{width}}  {'-' if v is None else f'{v:.6g}'}" for k, v in record["metrics"].items()]
    lines.append(f"wrote {record['path']}")
    return "\n".join(lines)


def parse(prog: str, description: str, argv: list[str] | None, export: bool = False) -> argparse.Namespace:
    """The command line of ``python -m runner.evaluate`` / ``runner.export``: the job folder, ``--weights``,
    (``--format`` for export, ``--out`` for evaluate) and Hydra overrides, in any order."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("job", type=Path, help="a finished job folder (outputs/<date>/<time>) holding .hydra/")
    parser.add_argument(
        "--weights", default="final", help="; ".join(f"{k}: {v[0]}" for k, v in WEIGHTS.items()) + " (default final)"
    )
    if export:
        parser.add_argument(
            "--format",
            required=True,
            help="torch: model.pt2 (torch.export); onnx: model.onnx; "
            "int8: model.int8.pt2 (int8 Linear layers, torchao; both accuracies printed)",
        )
    else:
        parser.add_argument("--out", type=Path, help="the record's file (default <job>/eval-<weights>.json)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the job's config (data=..., key=value)")
    trust.add_arguments(parser)
    return parser.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    """``python -m runner.evaluate JOB [--weights final|ema|best] [--out FILE] [overrides]``; returns the exit
    status: 0, or 2 with one ``error:`` line for bad input (nothing written)."""
    args = parse(
        "python -m runner.evaluate",
        "Evaluate a finished job's weights on its validation split "
        "(or the data the overrides name); writes eval-<weights>.json into the job folder.",
        argv,
    )
    try:
        policy = trust.Policy.make(args.trust, args.allow_target, args.job)
        record = evaluate(args.job, args.weights, args.overrides, args.out, policy)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(render(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
