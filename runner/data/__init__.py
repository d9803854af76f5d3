"""Datasets and loaders: the built-in image sets, character text, token files or the user's own datasets, behind a
``DataLoader`` or held whole on the device.

``build`` returns train/eval iterables that yield ``(x, y)`` already on the run's device (the copy inside the
iterable, so the data-wait figure includes it): built-in image sets, float32 ``x`` ``(B, C, H, W)`` and int64 ``y``
``(B,)``; ``data=custom``, the batch of the user's items ``(B, *S)`` and of their targets (int64 ``(B,)`` class
indices, float ``(B,)`` or ``(B, k)`` values); ``data=text``/``tokens``, int64 token windows ``(B, block_size)``.

Its modules: docs/design.md, "Where each concern lives". ``IN_MEMORY_DATA`` (the ``data.name`` values with an
in-memory form, ``dataloader=device``) is defined torch-free in ``runner/__init__.py`` for its
``${runner_in_memory:}`` resolver, and re-exported here.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from runner import IN_MEMORY_DATA
from runner.config import check_choice
from runner.data import text
from runner.data.batches import DeviceIterable, OnDeviceLoader, random_crop_flip
from runner.data.custom import custom_datasets, custom_source
from runner.data.images import IMAGE_DATASETS, STATS, image_source, images_as_tensor
from runner.data.loading import Data, assemble
from runner.data.source import Source
from runner.data.text import text_source
from runner.errors import ConfigError

__all__ = [
    "IMAGE_DATASETS",
    "IN_MEMORY_DATA",
    "STATS",
    "Data",
    "DeviceIterable",
    "OnDeviceLoader",
    "build",
    "custom_datasets",
    "images_as_tensor",
    "random_crop_flip",
    "source_for",
    "text",
]


def source_for(data_cfg: DictConfig, task=None) -> Source:
    """The ``Source`` of ``data.name``: ``text_source``, ``tokens.tokens_source``, ``custom_source`` (whose targets
    ``task.check_target`` checks; None: ``runner.task.Classification``'s class indices) or ``image_source``
    (``IMAGE_DATASETS``).

    Raises:
        ConfigError: an unknown ``data.name``, or whatever that source raises.
    """
    name = data_cfg.name
    check_choice("data.name", name)  # the built-ins of IMAGE_DATASETS, text, tokens and custom
    if name == "text":
        return text_source(data_cfg)
    if name == "tokens":
        from runner.data.tokens import tokens_source  # on use: python -m runner.data.tokens must import it first

        return tokens_source(data_cfg)
    if name == "custom":
        if task is None:
            from runner.task import Classification  # on use: the data package does not depend on the tasks

            task = Classification()
        return custom_source(data_cfg, task.check_target)
    return image_source(data_cfg)


def build(
    data_cfg: DictConfig,
    loader_cfg: DictConfig,
    env,
    *,
    seed: int = 0,
    memory_format: torch.memory_format = torch.contiguous_format,
    task=None,
) -> Data:
    """Build the train and eval iterables for this rank: ``source_for`` then ``loading.assemble``; ``task`` (a
    ``runner.protocols.Task``; None: a classification) checks ``data=custom``'s targets.

    Raises:
        ConfigError: unknown ``data.name``, a missing or corrupt dataset, ``batch_size`` <= 0, a
            per-rank training set smaller than one batch, ``on_device`` with a built-in dataset that has no
            in-memory form (imagefolder), a ``data.num_classes`` that contradicts a built-in dataset, or
            bad custom data (``custom_datasets``: targets the task refuses among them).
    """
    if loader_cfg.batch_size <= 0:
        raise ConfigError(f"dataloader.batch_size={loader_cfg.batch_size} must be a positive number of samples")
    return assemble(source_for(data_cfg, task), loader_cfg, env, seed=seed, memory_format=memory_format)
