"""Cross-key checks of a composed config, run before anything is built or written: what the schemas' types and
closed option lists (``runner.config``, checked by Hydra at compose time) cannot express; and Hydra's compose errors
as one line (``compose_error_line``).
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from runner import objective
from runner.config import CHOICES, check_choice
from runner.config.logger import LOGGER_PACKAGES, LOGGERS, logger_names
from runner.errors import ConfigError


def validate(cfg: DictConfig) -> None:
    """Cross-key checks that types alone cannot express; run before anything is built or written.

    Raises:
        ConfigError: naming the key, its value and the allowed range.
    """
    _refuse_schema_choices()
    t = cfg.trainer
    checks = [
        (cfg.dataloader.batch_size >= 1, "dataloader.batch_size", cfg.dataloader.batch_size, "must be >= 1"),
        (cfg.memory.accumulate_steps >= 1, "memory.accumulate_steps", cfg.memory.accumulate_steps, "must be >= 1"),
        (t.max_epochs >= 1, "trainer.max_epochs", t.max_epochs, "must be >= 1"),
        (t.max_steps is None or t.max_steps >= 1, "trainer.max_steps", t.max_steps, "must be >= 1 or null"),
        (t.warmup_steps >= 0, "trainer.warmup_steps", t.warmup_steps, "must be >= 0"),
        (t.log_every >= 1, "trainer.log_every", t.log_every, "must be >= 1"),
        (t.eval_every is None or t.eval_every >= 1, "trainer.eval_every", t.eval_every, "must be >= 1 or null"),
        (
            t.target_accuracy is None or 0 < t.target_accuracy <= 1,
            "trainer.target_accuracy",
            t.target_accuracy,
            "must be a fraction in (0, 1] or null",
        ),
        (
            0 <= t.max_skipped_fraction <= 1,
            "trainer.max_skipped_fraction",
            t.max_skipped_fraction,
            "must be a fraction in [0, 1]",
        ),
        (t.target_loss is None or t.target_loss > 0, "trainer.target_loss", t.target_loss, "must be > 0 or null"),
        (
            not t.stop_at_target or t.target_loss is not None or t.target_accuracy is not None,
            "trainer.stop_at_target",
            "true",
            "stops at the first evaluation meeting the targets: set trainer.target_loss or "
            "trainer.target_accuracy (or leave stop_at_target=false)",
        ),
        (
            not (cfg.compile.optimizer and cfg.optimizer.impl == "foreach"),
            "optimizer.impl",
            "foreach",
            "cannot "
            "run with compile.optimizer=true (foreach refuses its tensor LR): leave it null (Inductor fuses) or fused",
        ),
        (
            cfg.optimizer.clip_grad_norm is None or cfg.optimizer.clip_grad_norm > 0,
            "optimizer.clip_grad_norm",
            cfg.optimizer.clip_grad_norm,
            "must be > 0 or null",
        ),
        (
            t.ema_decay is None or 0 < t.ema_decay < 1,
            "trainer.ema_decay",
            t.ema_decay,
            "must be in (0, 1) (e.g. 0.999: the old average's weight per update) or null",
        ),
        (t.ema_every >= 1, "trainer.ema_every", t.ema_every, "must be >= 1"),
        (
            t.target_weights != "ema" or t.ema_decay is not None,
            "trainer.target_weights",
            t.target_weights,
            "reads the targets from the EMA's metrics: set trainer.ema_decay (e.g. 0.999) or target_weights=model",
        ),
        (0 <= t.seed < 2**32, "trainer.seed", t.seed, "must be in [0, 2**32) (NumPy's seed range)"),
        (
            t.eval_max_batches is None or t.eval_max_batches >= 1,
            "trainer.eval_max_batches",
            t.eval_max_batches,
            "must be >= 1 or null (an evaluation of no batch would report made-up figures)",
        ),
        *[
            (cfg.data.get(k) is None or cfg.data[k] >= 1, f"data.{k}", cfg.data.get(k), "must be >= 1")
            for k in ("train_size", "eval_size", "block_size")
            if k in cfg.data and cfg.data.name != "custom"
        ],
    ]
    for ok, key, value, rule in checks:
        if not ok:
            raise ConfigError(f"{key}={value} {rule}")
    for key in CHOICES:  # every closed option list (runner/config/), so a bad value stops before anything is built
        check_choice(key, OmegaConf.select(cfg, key))
    _refuse_undeclared_keys(cfg)
    objective.check(cfg)
    check_logger_packages(logger_names(cfg.logger))


def check_logger_packages(names: list[str]) -> None:
    """Refuse a logger whose package is not installed (``logger=mlflow`` without mlflow), before training.

    Raises:
        ConfigError: naming the logger, the package and the pip command that installs it.
    """
    import importlib.util

    for name in names:
        module, pip = LOGGER_PACKAGES[name]
        try:
            found = module is None or importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a broken install, or a module without a spec
            found = False
        if not found:
            raise ConfigError(
                f"logger={name} needs the {module} package, which is not installed: {pip}; or drop {name} from logger="
            )


def logger_override_error(exc: BaseException, overrides: list[str]) -> str | None:
    """One line for Hydra's compose error about a logger: an unknown one (``logger=foo``, ``logger=[wandb,foo]``:
    "Could not find/load 'logger/foo'"), or a setting of a logger the run does not pick
    (``logger.mlflow.tracking_uri=...`` without ``logger=mlflow``: its node is null, and OmegaConf fails with an
    AssertionError). None for any other error."""
    import re

    unknown = re.search(r"Could not (?:find|load) 'logger/([^']+)'", str(exc))
    if unknown:
        return (
            f"logger={unknown[1]} is not a logger; pick one of {', '.join(LOGGERS)} (logger=tensorboard), "
            f"several as a list (logger=[wandb,tensorboard]) or logger=none"
        )
    if isinstance(exc, AssertionError) and "Unexpected type for root" in str(exc):
        for override in overrides:
            key = override.lstrip("+~").split("=", 1)[0]
            parts = key.split(".")
            if len(parts) > 2 and parts[0] == "logger" and parts[1] in LOGGERS:
                return (
                    f"{key} is a setting of logger={parts[1]}, which this run does not pick; add {parts[1]} "
                    f"to the loggers (logger={parts[1]}, or logger=[wandb,{parts[1]}] for several)"
                )
    return None


def _refuse_undeclared_keys(cfg: DictConfig) -> None:
    """A key added with ``+`` that no schema declares (``+trainer.max_step=3``: the fix Hydra suggests for a
    misspelt key) would be accepted and ignored; refuse it, naming the close declared key. The open nodes
    (``model``, ``data=custom``, a task of your own: a constructor's or function's arguments) are checked by their
    builders.

    Raises:
        ConfigError: naming the key and the declared keys it is closest to.
    """
    import dataclasses

    for name, node in cfg.items():
        schema = OmegaConf.get_type(node) if isinstance(node, DictConfig) else None
        own_task = name == "task" and str(node.get("_target_") or "").startswith("runner.")
        if not dataclasses.is_dataclass(schema) or (OmegaConf.is_struct(node) is False and not own_task):
            continue  # not a schema'd node, or an open one (its builder checks the names): a task of your own's keys
            # are its constructor's arguments (runner.task.build checks), runner's own tasks take what they declare
        declared = [f.name for f in dataclasses.fields(schema)]
        why = f"{node.get('_target_')} takes no such argument" if own_task else "added with '+', it would be ignored"
        for key in node.keys():
            if key not in declared:
                raise ConfigError(undeclared_key(name, str(key), declared, why))


#: The names PyTorch Lightning's Trainer and the Hugging Face Trainer give runner's settings: a key of theirs typed as
#: an override is pointed to runner's (``undeclared_key``), an option of theirs to runner's (``unknown_option``)
HABITS = {
    "gradient_clip_val": "optimizer.clip_grad_norm",
    "max_grad_norm": "optimizer.clip_grad_norm",
    "accumulate_grad_batches": "memory.accumulate_steps",
    "gradient_accumulation_steps": "memory.accumulate_steps",
    "max_epochs": "trainer.max_epochs",
    "num_train_epochs": "trainer.max_epochs",
    "max_steps": "trainer.max_steps",
    "learning_rate": "optimizer.lr",
    "lr": "optimizer.lr",
    "per_device_train_batch_size": "dataloader.batch_size",
    "batch_size": "dataloader.batch_size",
    "val_check_interval": "trainer.eval_every",
    "eval_steps": "trainer.eval_every",
    "log_every_n_steps": "trainer.log_every",
    "logging_steps": "trainer.log_every",
    "seed": "trainer.seed",
    "accelerator": "trainer.device (cpu, cuda or auto)",
    "precision": "precision=<amp|bf16|fp32|tf32|fp8>",
    "bf16": "precision=bf16",
    "fp16": "precision=amp",
    "devices": "torchrun --nproc-per-node=<N> -m runner distributed=ddp (docs/scaling.md)",
    "strategy": "distributed=<ddp|fsdp>",
    "num_nodes": "sbatch scripts/multinode.sh (docs/scaling.md)",
    "gradient_checkpointing": "memory=checkpointing",
    "torch_compile": "compile=default",
    "dataloader_num_workers": "dataloader.num_workers",
    "dataloader_pin_memory": "dataloader=pinned",
}
#: Lightning's ``precision=`` values and runner's option for each
PRECISION_HABITS = {
    "16-mixed": "amp",
    "16": "amp",
    "bf16-mixed": "bf16",
    "bf16-true": "bf16",
    "32": "fp32",
    "32-true": "fp32",
    "transformer-engine": "fp8",
}


def undeclared_key(node: str, key: str, declared, why: str) -> str:
    """One line for a key runner does not read: ``<node>.<key>``, ``why``, runner's key where it is a Lightning or
    Hugging Face Trainer name (``HABITS``), else the close declared key (did you mean ...?), and the node's keys.
    ``node`` is "" for a top-level key."""
    import difflib

    where = f"{node}." if node else ""
    close = difflib.get_close_matches(key, sorted(declared), n=1)
    hint = f"; did you mean {where}{close[0]}?" if close else "."
    if key in HABITS and f"{where}{key}" != HABITS[key]:
        hint = f"; runner's setting for it is {HABITS[key]}."
    return (
        f"{where}{key} is not a setting runner reads ({why}){hint} The {node or 'top-level'} keys are: "
        f"{', '.join(sorted(declared))}"
    )


def misspelt_override(exc: BaseException) -> str | None:
    """The ``undeclared_key`` line for Hydra's compose error about a key no schema declares
    (``ConfigCompositionException: Could not override 'trainer.max_step'``, whose cause, OmegaConf's
    ``ConfigKeyError``, names the key and the schema it is missing from), instead of Hydra's advice to add it
    with ``+`` (which ``_refuse_undeclared_keys`` would then refuse). None for any other error."""
    import dataclasses

    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    from runner.config import CHECKPOINT_DEFAULTS

    cause, full_key = exc.__cause__, getattr(exc.__cause__, "full_key", None)
    if (
        not str(exc).startswith("Could not override")
        or not full_key
        or not isinstance(cause, (ConfigKeyError, ConfigAttributeError))
    ):
        return None
    node, _, key = str(full_key).rpartition(".")
    schema = getattr(cause, "object_type", None)
    if dataclasses.is_dataclass(schema):
        declared = [f.name for f in dataclasses.fields(schema) if f.name != "defaults"]
    elif node == "checkpoint":
        declared = list(CHECKPOINT_DEFAULTS)
    else:
        return None
    return undeclared_key(node, key, declared, "the schema has no such key")


def compose_error_line(exc: BaseException, overrides: list[str]) -> str | None:
    """runner's one line for a Hydra compose error of the command line, or None (Hydra's own message stays):
    a logger (``logger_override_error``), a misspelt key (``misspelt_override``), a value of the wrong type
    (``wrong_type_override``), an option a group does not have (``unknown_option``)."""
    from hydra.errors import ConfigCompositionException

    message = logger_override_error(exc, overrides)
    if message is None and isinstance(exc, ConfigCompositionException):
        message = misspelt_override(exc) or wrong_type_override(exc) or unknown_option(exc, overrides)
    return message


#: OmegaConf's word for a type (in "could not be converted to <word>") -> what runner says and an example value
_TYPE_WORDS = {"Integer": ("an integer", "10"), "Float": ("a float", "0.1"), "bool": ("true or false", "true")}


def wrong_type_override(exc: BaseException) -> str | None:
    """One line for Hydra's "Error merging override optimizer.lr=abc" (OmegaConf's ``ValidationError``: a value
    the schema's type does not take): ``optimizer.lr=abc: expected a float (e.g. optimizer.lr=0.01)``, the type
    and the example (the schema's default) read from the field's declaration. None for any other error."""
    import re

    from omegaconf.errors import ValidationError

    text, cause = str(exc), exc.__cause__
    if not text.startswith("Error merging override ") or not isinstance(cause, ValidationError):
        return None
    override = text.removeprefix("Error merging override ").strip()
    full_key = str(getattr(cause, "full_key", None) or override.split("=", 1)[0].lstrip("+~"))
    key = full_key.split("[", 1)[0]  # data.shape[0]: an item of the list data.shape
    expected, example = _field_type(getattr(cause, "object_type", None), key.rpartition(".")[2])
    if expected is None:
        reason = str(cause).splitlines()[0]
        word = re.search(r"converted to (\w+)|not a valid (bool)", reason)
        if word is None or (word[1] or word[2]) not in _TYPE_WORDS:
            return f"{override}: {reason}"
        expected, example = _TYPE_WORDS[word[1] or word[2]]
        if key != full_key:
            return f"{override}: {full_key} must be {expected} (e.g. {example})"
    return f"{override}: expected {expected} (e.g. {key}={example})"


def _field_type(schema: object, name: str) -> tuple[str | None, str | None]:
    """What field ``name`` of dataclass ``schema`` takes, in words, and an example value (its default where it
    has one); (None, None) where the schema does not say."""
    import dataclasses
    import types
    import typing

    fields = {f.name: f for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else {}
    if name not in fields:
        return None, None
    try:
        hint = typing.get_type_hints(schema)[name]
    except Exception:  # noqa: BLE001 - an annotation that does not evaluate: no words for it
        return None, None
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1
    hint = args[0] if optional else hint
    f = fields[name]
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    if typing.get_origin(hint) is list:
        item = (typing.get_args(hint) or (str,))[0]
        words = {int: "integers", float: "floats", bool: "true/false values"}.get(item, "strings")
        example = default if isinstance(default, list) and default else [_TYPE_WORDS["Integer"][1]]
        expected = f"a list of {words}"
        shown = "[" + ",".join(str(v) for v in example) + "]"
    else:
        word = {int: "Integer", float: "Float", bool: "bool"}.get(hint)
        if word is None:
            return None, None
        expected, shown = _TYPE_WORDS[word]
        if isinstance(default, hint) and not (hint is int and isinstance(default, bool)):
            shown = str(default).lower() if hint is bool else str(default)
    return expected + (" or null" if optional else ""), shown


def unknown_option(exc: BaseException, overrides: list[str]) -> str | None:
    """One line for Hydra's "Could not find 'model/resnet19'" (``MissingConfigException``: a group option that is
    in no config folder), with the close options (difflib over the group's options: runner's ``conf/<group>/``,
    a ``--config-dir`` of the user's, the schemas registered for the group) instead of Hydra's search-path dump:
    ``model=resnet19: no such option in group model; did you mean resnet18? (options: ...)``. None for any other
    error (the primary config, a file named by path)."""
    import difflib

    from hydra.errors import MissingConfigException

    from runner import CONF_DIR

    missing = getattr(exc, "missing_cfg_file", None) if isinstance(exc, MissingConfigException) else None
    if not missing or "/" not in missing:
        return None
    group, _, name = missing.rpartition("/")
    found = set(getattr(exc, "options", None) or []) | {p.stem for p in (CONF_DIR / group).glob("*.yaml")}
    options = sorted(o for o in found if not o.startswith("base_"))
    typed = next(
        (
            o
            for o in overrides
            if o.lstrip("+~").split("=", 1)[0].split("@", 1)[0] == group and name in o.split("=", 1)[-1]
        ),
        f"{group}={name}",
    )
    close = difflib.get_close_matches(name, options, n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    if group == "precision" and name in PRECISION_HABITS:
        hint = f"; Lightning's {name} is runner's precision={PRECISION_HABITS[name]}"
    return f"{typed}: no such option in group {group}{hint} (options: {', '.join(options) or 'none'})"


def _refuse_schema_choices() -> None:
    """A group option that is one of the ``base_<name>`` schemas (``optimizer=base_optimizer``) is what the
    options extend, not an option: its required fields are unset, and reading them would end in a
    ``MissingMandatoryValue`` traceback. Outside a Hydra run (``train(cfg)`` called directly) there is no choice.

    Raises:
        ConfigError: naming the group, the schema and where the options are listed.
    """
    from hydra.core.hydra_config import HydraConfig

    from runner import CONF_DIR

    if not HydraConfig.initialized():
        return
    for group, choice in HydraConfig.get().runtime.choices.items():
        if isinstance(choice, str) and choice.startswith("base_") and not group.startswith("hydra"):
            options = ", ".join(sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml")))
            raise ConfigError(
                f"{group}={choice} is the schema every {group} option extends, not an option; "
                f"pick {group}=<one of {options}> (`python -m runner --help` lists yours too)"
            )
