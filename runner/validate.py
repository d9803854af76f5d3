"""Cross-key checks of a composed config, run before anything is built or written.

Types and closed option lists come from the schemas (``runner.config``: Hydra refuses a misspelt key or a wrong
type at compose time); what types cannot express (ranges, a key added with ``+`` that no schema declares) is
checked here, each failure one ``ConfigError`` naming the key, its value and the rule.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from runner.config import CHOICES, LOGGER_PACKAGES, LOGGERS, check_choice, logger_names
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
        (t.target_accuracy is None or 0 < t.target_accuracy <= 1, "trainer.target_accuracy", t.target_accuracy,
         "must be a fraction in (0, 1] or null"),
        (0 <= t.max_skipped_fraction <= 1, "trainer.max_skipped_fraction", t.max_skipped_fraction,
         "must be a fraction in [0, 1]"),
        (t.target_loss is None or t.target_loss > 0, "trainer.target_loss", t.target_loss, "must be > 0 or null"),
        (not t.stop_at_target or t.target_loss is not None or t.target_accuracy is not None, "trainer.stop_at_target",
         "true", "stops at the first evaluation meeting the targets: set trainer.target_loss or "
         "trainer.target_accuracy (or leave stop_at_target=false)"),
        (cfg.optimizer.clip_grad_norm is None or cfg.optimizer.clip_grad_norm > 0, "optimizer.clip_grad_norm",
         cfg.optimizer.clip_grad_norm, "must be > 0 or null"),
        (t.ema_decay is None or 0 < t.ema_decay < 1, "trainer.ema_decay", t.ema_decay,
         "must be in (0, 1) (e.g. 0.999: the old average's weight per update) or null"),
        (t.ema_every >= 1, "trainer.ema_every", t.ema_every, "must be >= 1"),
        (0 <= t.seed < 2**32, "trainer.seed", t.seed, "must be in [0, 2**32) (NumPy's seed range)"),
        (t.eval_max_batches is None or t.eval_max_batches >= 1, "trainer.eval_max_batches", t.eval_max_batches,
         "must be >= 1 or null (an evaluation of no batch would report made-up figures)"),
        *[(cfg.data.get(k) is None or cfg.data[k] >= 1, f"data.{k}", cfg.data.get(k), "must be >= 1")
          for k in ("train_size", "eval_size", "block_size") if k in cfg.data and cfg.data.name != "custom"],
    ]
    for ok, key, value, rule in checks:
        if not ok:
            raise ConfigError(f"{key}={value} {rule}")
    for key in CHOICES:  # every closed option list (runner/config.py), so a bad value stops before anything is built
        check_choice(key, OmegaConf.select(cfg, key))
    _refuse_undeclared_keys(cfg)
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
            raise ConfigError(f"logger={name} needs the {module} package, which is not installed: {pip}; "
                              f"or drop {name} from logger=")


def logger_override_error(exc: BaseException, overrides: list[str]) -> str | None:
    """One line for Hydra's compose error about a logger: an unknown one (``logger=foo``, ``logger=[wandb,foo]``:
    "Could not find/load 'logger/foo'"), or a setting of a logger the run does not pick
    (``logger.mlflow.tracking_uri=...`` without ``logger=mlflow``: its node is null, and OmegaConf fails with an
    AssertionError). None for any other error."""
    import re

    unknown = re.search(r"Could not (?:find|load) 'logger/([^']+)'", str(exc))
    if unknown:
        return (f"logger={unknown[1]} is not a logger; pick one of {', '.join(LOGGERS)} (logger=tensorboard), "
                f"several as a list (logger=[wandb,tensorboard]) or logger=none")
    if isinstance(exc, AssertionError) and "Unexpected type for root" in str(exc):
        for override in overrides:
            key = override.lstrip("+~").split("=", 1)[0]
            parts = key.split(".")
            if len(parts) > 2 and parts[0] == "logger" and parts[1] in LOGGERS:
                return (f"{key} is a setting of logger={parts[1]}, which this run does not pick; add {parts[1]} "
                        f"to the loggers (logger={parts[1]}, or logger=[wandb,{parts[1]}] for several)")
    return None


def _refuse_undeclared_keys(cfg: DictConfig) -> None:
    """A key added with ``+`` that no schema declares (``+trainer.max_step=3``: the fix Hydra suggests for a
    misspelt key) would be accepted and ignored; refuse it, naming the close declared key. The open nodes
    (``model``, ``data=custom``: a constructor's or function's arguments) are checked by their builders.

    Raises:
        ConfigError: naming the key and the declared keys it is closest to.
    """
    import dataclasses

    for name, node in cfg.items():
        schema = OmegaConf.get_type(node) if isinstance(node, DictConfig) else None
        if not dataclasses.is_dataclass(schema) or OmegaConf.is_struct(node) is False:
            continue  # not a schema'd node, or an open one (its builder checks the names)
        declared = [f.name for f in dataclasses.fields(schema)]
        for key in node.keys():
            if key not in declared:
                raise ConfigError(undeclared_key(name, str(key), declared, "added with '+', it would be ignored"))


def undeclared_key(node: str, key: str, declared, why: str) -> str:
    """One line for a key runner does not read: ``<node>.<key>``, ``why``, the close declared key
    (did you mean ...?) and the node's keys. ``node`` is "" for a top-level key."""
    import difflib

    where = f"{node}." if node else ""
    close = difflib.get_close_matches(key, sorted(declared), n=1)
    hint = f"; did you mean {where}{close[0]}?" if close else "."
    return (f"{where}{key} is not a setting runner reads ({why}){hint} The {node or 'top-level'} keys are: "
            f"{', '.join(sorted(declared))}")


def misspelt_override(exc: BaseException) -> str | None:
    """The ``undeclared_key`` line for Hydra's compose error about a key no schema declares
    (``ConfigCompositionException: Could not override 'trainer.max_step'``, whose cause, OmegaConf's
    ``ConfigKeyError``, names the key and the schema it is missing from), instead of Hydra's advice to add it
    with ``+`` (which ``_refuse_undeclared_keys`` would then refuse). None for any other error."""
    import dataclasses

    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    from runner.config import CHECKPOINT_DEFAULTS

    cause, full_key = exc.__cause__, getattr(exc.__cause__, "full_key", None)
    if not str(exc).startswith("Could not override") or not full_key or not isinstance(cause, (ConfigKeyError,
                                                                                              ConfigAttributeError)):
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
            raise ConfigError(f"{group}={choice} is the schema every {group} option extends, not an option; "
                              f"pick {group}=<one of {options}> (`python -m runner --help` lists yours too)")
