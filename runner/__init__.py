"""runner: a config-driven PyTorch experiment runner that measures what each speed technique buys."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

__version__ = "0.1.0"

#: The repository root (the folder holding conf/ and data/) for an editable install.
REPO_ROOT = Path(__file__).resolve().parent.parent

if not OmegaConf.has_resolver("runner_root"):
    OmegaConf.register_new_resolver("runner_root", lambda: str(REPO_ROOT))
