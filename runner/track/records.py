"""How figures are written, for the console's tracker and every logger alike: strict JSON (non-finite floats as
null), files replaced atomically, the loggers' panel names for the metrics rows, a reachability check for a
tracking server, and the SHA-256 of the weights files a run writes (``summary.json`` ``weights_sha256``), which
``python -m runner.evaluate`` and ``runner.export`` check before they load them (``check_weights``).
"""

from __future__ import annotations

import hashlib
import json
import math
import socket
import urllib.parse
from pathlib import Path
from typing import Any

from runner.files import replace_own

# metrics.jsonl key -> logger key (panel prefix), for every logger (W&B, TensorBoard, MLflow); W&B logs the rows
# against the step metric "trainer/step", the others against the optimizer step itself.
WANDB_KEYS = {
    "samples_per_sec": "perf/samples_per_sec",
    "tokens_per_sec": "perf/tokens_per_sec",
    "step_time_ms": "perf/step_time_ms",
    "data_wait_ms": "perf/data_wait_ms",
    "peak_memory_mb": "perf/peak_memory_mb",
    "loss": "train/loss",
    "lr": "train/lr",
    "epoch": "train/epoch",
    "eval_accuracy": "eval/accuracy",
    "eval_loss": "eval/loss",
    "eval_perplexity": "eval/perplexity",
    "eval_bits_per_char": "eval/bits_per_char",
    "grad_norm": "train/grad_norm",
    "eval_loss_ema": "eval/loss_ema",
    "eval_accuracy_ema": "eval/accuracy_ema",
}


def panel_figures(row: dict[str, Any]) -> dict[str, Any]:
    """A metrics row's figures under their logger keys (``WANDB_KEYS``); keys it does not map and nulls left out."""
    return {WANDB_KEYS[k]: v for k, v in row.items() if k in WANDB_KEYS and v is not None}


def summary_figures(summary: dict[str, Any]) -> dict[str, float]:
    """The summary's top-level numbers (``samples_per_sec``, ``eval_accuracy``, ...; no bools, no nulls)."""
    return {k: float(v) for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def finite_or_none(obj: Any) -> Any:
    """``obj`` with every NaN/inf float replaced by None (recursively through dicts, lists and tuples), so it
    serializes as strict JSON: ``NaN`` is not JSON and most parsers reject it."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    return obj


def to_json(obj: Any, **kwargs: Any) -> str:
    """Strict JSON (RFC 8259): non-finite floats become null, anything else unknown its ``str``."""
    return json.dumps(finite_or_none(obj), allow_nan=False, default=str, **kwargs)


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as strict JSON to ``path`` via a temporary file and ``os.replace`` (atomic on POSIX), so
    a crash or a full disk never leaves a half-written file under the final name; a link at either name is
    replaced, never written through (``runner.files.replace_own``)."""
    replace_own(path, to_json(obj, indent=2) + "\n")


def reachable(url: str, timeout_s: float = 3.0) -> bool:
    """Whether a TCP connection to ``url``'s host and port opens within ``timeout_s`` seconds."""
    parsed = urllib.parse.urlsplit(url if "//" in url else f"https://{url}")
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname or "", port), timeout=timeout_s):
            return True
    except OSError:
        return False


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """The SHA-256 of the file at ``path`` (hex), read 4 MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def check_weights(folder: Path, path: Path) -> bool:
    """Check the weights file ``path`` of job ``folder`` against the SHA-256 its run recorded in ``summary.json``
    (``weights_sha256``, keyed by the path relative to the folder). Returns False when nothing was recorded for it
    (a run written before runner kept checksums, or one that did not finish: nothing to check against).

    Raises:
        ConfigError: the file's SHA-256 differs from the recorded one (modified or corrupted since it was written).
    """
    from runner.errors import ConfigError

    try:
        summary = json.loads((Path(folder) / "summary.json").read_text())
        recorded = (summary.get("weights_sha256") or {}).get(Path(path).relative_to(folder).as_posix())
    except (OSError, ValueError, AttributeError):
        return False
    if not isinstance(recorded, str):
        return False
    actual = sha256_file(path)
    if actual != recorded:
        raise ConfigError(
            f"cannot read {path}: it was modified or corrupted after the run wrote it (its SHA-256 is "
            f"{actual[:16]}..., the run recorded {recorded[:16]}... in {Path(folder) / 'summary.json'}); "
            f"restore the file or train the job again"
        )
    return True
