"""runner: a config-driven PyTorch experiment runner that measures what each speed technique buys."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from omegaconf import OmegaConf

__version__ = "0.1.0"
#: ``time.perf_counter()`` when runner was first imported: the start of a job's start-up (``one_time.startup_s``)
STARTED_S = time.perf_counter()

#: The ``runner`` package folder.
PACKAGE_DIR = Path(__file__).resolve().parent
#: The repository root (the folder holding conf/ and data/) of a source checkout or an editable install.
REPO_ROOT = PACKAGE_DIR.parent
#: True for a regular install (``pip install .``, a wheel, a git URL): the build maps the top-level conf/
#: and the embedded data/ into the package (pyproject.toml ``[tool.setuptools.package-dir]``), as
#: ``runner/conf/`` and ``runner/embedded_data/``. A checkout or an editable install reads them in place.
INSTALLED = (PACKAGE_DIR / "conf").is_dir()
#: runner's own configs, the search path entry of ``python -m runner`` (a user's configs join them through
#: ``--config-dir`` or ``hydra.searchpath``).
CONF_DIR = PACKAGE_DIR / "conf" if INSTALLED else REPO_ROOT / "conf"
#: ``data.root`` (and the Shakespeare presets' folder) when ``RUNNER_DATA_ROOT`` is not set: the repo's data/, or the
#: package's copy of it in a regular install: the embedded MNIST (``<DATA_DIR>/MNIST/raw/*.gz``) and Tiny
#: Shakespeare (``<DATA_DIR>/tinyshakespeare/input.txt``, nanoGPT's character-level corpus, 1,115,394 characters).
DATA_DIR = PACKAGE_DIR / "embedded_data" if INSTALLED else REPO_ROOT / "data"


def cache_dir() -> Path:
    """Where runner writes what it derives from files it must not change (the MNIST archives of a regular
    install are extracted here): ``$XDG_CACHE_HOME/runner``, else ``~/.cache/runner``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "runner"


# ${runner_root:}: the checkout's root (for configs that name a repo path); ${runner_data_root:}: DATA_DIR,
# data.root's default when RUNNER_DATA_ROOT is not set.
if not OmegaConf.has_resolver("runner_root"):
    OmegaConf.register_new_resolver("runner_root", lambda: str(REPO_ROOT))
if not OmegaConf.has_resolver("runner_data_root"):
    OmegaConf.register_new_resolver("runner_data_root", lambda: str(DATA_DIR))


#: The ``data.name`` values whose data has an in-memory form, so ``dataloader.on_device`` (``dataloader=device``)
#: applies: every built-in but imagefolder (read from image files one by one; ``tokens`` is memory-mapped, and
#: on_device loads its files whole). ``custom`` is tried: its data goes
#: on the device when it is whole tensors (a TensorDataset or a Subset of one), else ``on_device_data`` is
#: recorded as skipped. Defined here, torch-free, for the ``${runner_in_memory:}`` resolver below (composing a
#: config imports no torch); ``runner.data`` re-exports it, and tests/test_data.py checks its sources agree.
IN_MEMORY_DATA: tuple[str, ...] = ("mnist", "cifar10", "synthetic", "text", "tokens", "custom")


# Hardware-aware presets (conf/experiment/fast.yaml): a YAML file cannot see the hardware, these can.
#   ${runner_if_cuda:${trainer.device},A,B}  A when the job will run on CUDA, else B
#   ${runner_mul:A,B}                        A x B (e.g. a batch size scaled from optimizer.base_batch_size)
#   ${runner_in_memory:${data.name}}         true for the datasets that have an in-memory form, so
#                                            dataloader.on_device works (IN_MEMORY_DATA above)
#   ${runner_steps:S,B}                      the optimizer steps of S samples at batch B: ceil(S / B), at least 1
#                                            (conf/experiment/convergence.yaml: a budget in samples)
#   ${runner_for_tokens:${task._target_},A,B} "A,B," for a language model's task, else "" (conf/experiment/
#                                            ablation.yaml: the variants that act on token ids only)
def _if_cuda(device, then, otherwise):
    from runner.measure.hardware import uses_cuda  # imported on first use only (it imports torch): composing stays fast

    return then if uses_cuda(str(device)) else otherwise


def language_model_task(target: object) -> bool:
    """Whether a task's ``_target_`` names runner's language-model task (its inputs are token ids)."""
    return "LanguageModel" in str(target)


_RESOLVERS = {
    "runner_if_cuda": _if_cuda,
    "runner_mul": lambda a, b: a * b,
    "runner_in_memory": lambda name: name in IN_MEMORY_DATA,
    "runner_steps": lambda samples, batch: max(1, -(-int(samples) // int(batch))),
    "runner_for_tokens": lambda target, *names: "".join(f"{n}," for n in names) if language_model_task(target) else "",
}


def _config_groups() -> str:
    """``${runner_config_groups:}``: the group list of ``python -m runner --help`` (conf/hydra/help/runner.yaml).

    Hydra resolves the help template on every composition, not only for ``--help``; listing every group's options
    costs ~1 s there, so the list is built only when the command line asks for help."""
    import sys

    if not {"--help", "-h"} & set(sys.argv[1:]):
        return "(python -m runner --help lists them)"
    from runner.config.help import config_groups_help  # imported on use: this module stays light

    return config_groups_help()


_RESOLVERS["runner_config_groups"] = _config_groups
for _name, _fn in _RESOLVERS.items():
    if not OmegaConf.has_resolver(_name):
        OmegaConf.register_new_resolver(_name, _fn)


def _hide_schema_options() -> None:
    """Hydra lists a group's options (``model=nope``'s "Available options", ``model=glob(*)``, shell
    completion) from every config source, the ConfigStore's ``base_<name>`` schemas (``runner.config``)
    included; they are what YAML options extend, never a choice, so the listing leaves them out. Loading
    one by name, as the options' ``defaults: [base_model, _self_]`` do, is unchanged. (The repository is
    patched, not the ConfigStore's source class: Hydra's plugin scan re-imports that module.)"""
    from hydra._internal.config_repository import ConfigRepository
    from hydra.core.config_store import ConfigStore
    from hydra.core.object_type import ObjectType

    listed = ConfigRepository.get_group_options
    if getattr(listed, "runner_hides_schemas", False):
        return

    def schema(group: str, name: str) -> bool:
        try:
            return name.startswith("base_") and f"{name}.yaml" in ConfigStore.instance().list(group)
        except OSError:  # not a ConfigStore group
            return False

    def options(self, group_name: str, results_filter=ObjectType.CONFIG):
        return [name for name in listed(self, group_name, results_filter) if not schema(group_name, name)]

    options.runner_hides_schemas = True  # type: ignore[attr-defined]
    ConfigRepository.get_group_options = options  # type: ignore[method-assign]


_hide_schema_options()


#: Other libraries' log lines that are noise on runner's console, by logger: each message (its format string)
#: starting with one of these is dropped. torch.utils.cpp_extension warns "No CUDA runtime is found, using
#: CUDA_HOME='/usr/local/cuda'" when it is imported on a machine without a GPU but with a CUDA toolkit folder --
#: which inductor does whenever it compiles on a CPU (compile=...); no setting or variable silences it
#: (torch/utils/cpp_extension.py ``_find_cuda_home``), and it says nothing about the run.
#: torchao (0.18) registers its enums with pytree's register_constant on import, and torch logs a deprecation warning
#: per enum ("... is an Enum subclass and is now natively supported by torch.compile"): nothing about the run.
LIBRARY_NOISE = {
    "torch.utils.cpp_extension": ("No CUDA runtime is found",),
    "torch.utils._pytree": ("%s is an Enum subclass",),
}


class _DropNoise(logging.Filter):
    """A logger filter that drops the records whose message starts with one of ``prefixes``."""

    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:  # noqa: D102 - the class says it
        return not str(record.msg).startswith(self.prefixes)


def _quiet_library_noise() -> None:
    """Install ``LIBRARY_NOISE``'s filters on their loggers (before the libraries log: a logger's filters apply to
    every record made through it, and Hydra's logging setup keeps them). Idempotent."""
    for name, prefixes in LIBRARY_NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNoise) for f in logger.filters):
            logger.addFilter(_DropNoise(prefixes))


_quiet_library_noise()
