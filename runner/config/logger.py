"""The ``logger`` group's schema (``LoggerConfig``, one node per logger picked), the loggers runner knows
(``LOGGERS``) and the package each needs (``LOGGER_PACKAGES``): the loggers themselves are in runner/track/."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

#: The loggers ``logger=`` picks, one or several (``logger=[wandb,tensorboard]``); each is a ``conf/logger/<name>.yaml``
#: that fills ``logger.<name>`` (``logger=none``: none of them). The package each needs: ``LOGGER_PACKAGES``.
LOGGERS = ("wandb", "tensorboard", "mlflow", "csv")
#: logger -> (the module it imports, the pip command that installs it)
LOGGER_PACKAGES = {
    "wandb": ("wandb", "pip install wandb"),
    "tensorboard": ("tensorboard", 'pip install tensorboard (or pip install -e ".[tensorboard]")'),
    "mlflow": ("mlflow", 'pip install mlflow (or pip install -e ".[mlflow]")'),
    "csv": (None, None),
}


@dataclass
class WandbLoggerConfig:
    """``logger.wandb``: present when W&B is one of the loggers (project, entity, tags: ``logger.*``)."""


@dataclass
class TensorBoardLoggerConfig:
    """``logger.tensorboard``: present when TensorBoard is one of the loggers (``<job folder>/tensorboard/``)."""


@dataclass
class MLflowLoggerConfig:
    """``logger.mlflow``: present when MLflow is one of the loggers."""

    # null: $MLFLOW_TRACKING_URI, else a SQLite store in <job folder>/mlruns/ (runner.track.loggers.mlflow_tracking_uri)
    tracking_uri: Optional[str] = None


@dataclass
class CSVLoggerConfig:
    """``logger.csv``: present when ``metrics.csv`` is one of the loggers."""


@dataclass
class LoggerConfig:
    """``logger`` group: which loggers run (a node per logger picked; null = not picked) and what they share."""

    project: str = "runner"  # the W&B project, the MLflow experiment
    entity: Optional[str] = None  # the W&B entity (user or team); null = the key's default
    tags: list[str] = field(default_factory=list)  # W&B tags, MLflow run tags
    wandb: Optional[WandbLoggerConfig] = None
    tensorboard: Optional[TensorBoardLoggerConfig] = None
    mlflow: Optional[MLflowLoggerConfig] = None
    csv: Optional[CSVLoggerConfig] = None


def logger_names(logger: Any) -> list[str]:
    """The loggers a composed ``logger`` node picks, in ``LOGGERS`` order (``[]`` for ``logger=none``)."""
    return [name for name in LOGGERS if logger.get(name) is not None]
