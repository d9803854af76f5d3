"""Checkpoints: the whole training state through ``torch.distributed.checkpoint`` (DCP,
https://pytorch.org/docs/stable/distributed.checkpoint.html), atomic, optionally async: one code path for one
process, DDP and FSDP2, as torchtitan's checkpointer. The layout, the atomic rename, ``keep_last``,
``checkpoint.async`` and ``sha256.json``: docs/checkpointing.md, "What is saved"; why loading never runs code from
the checkpoint (https://pytorch.org/docs/stable/notes/serialization.html#weights-only): "What is safe to load".
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import random
import re
import shutil
import threading
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from runner.checkpoint import write_failures
from runner.errors import ConfigError
from runner.files import own_folder, replace_own, write_own
from runner.track.records import sha256_file

# one process without a process group is DCP's supported "no_dist" case (passed explicitly below), not a mistake
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

FOLDER = "checkpoints"
META_FILE = "runner.json"
DIGEST_FILE = "sha256.json"
_COMPLETE = re.compile(r"^step_(\d{8,})$")


def step_name(step: int) -> str:
    """The folder name of the checkpoint taken after optimizer step ``step``: ``step_00000200``."""
    return f"step_{step:08d}"


def is_complete(path: Path) -> bool:
    """True for a finished checkpoint folder: named ``step_<N>``, holding DCP's ``.metadata`` and ``runner.json``."""
    return bool(_COMPLETE.match(path.name)) and (path / ".metadata").is_file() and (path / META_FILE).is_file()


def complete_checkpoints(root: Path) -> list[Path]:
    """The complete checkpoints under ``root`` (a job's ``checkpoints/`` folder), oldest step first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and is_complete(p)]
    return sorted(found, key=lambda p: int(_COMPLETE.match(p.name).group(1)))


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or None. Partial folders are never returned."""
    found = complete_checkpoints(root)
    return found[-1] if found else None


def read_meta(path: Path) -> dict[str, Any]:
    """runner's facts about checkpoint ``path`` (``runner.json``).

    Raises:
        ConfigError: ``path`` is not a checkpoint folder, or its ``runner.json`` is unreadable/corrupt.
    """
    if not path.is_dir():
        raise ConfigError(
            f"checkpoint.resume={path} does not exist; pass a checkpoint folder "
            f"(<job>/checkpoints/step_<N>), auto or never"
        )
    meta_file = path / META_FILE
    if not (path / ".metadata").is_file() or not meta_file.is_file():
        raise ConfigError(
            f"{path} is not a complete runner checkpoint (it needs .metadata and {META_FILE}); "
            f"point checkpoint.resume at a <job>/checkpoints/step_<N> folder, or use never"
        )
    try:
        meta = json.loads(meta_file.read_text())
        int(meta["step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"corrupt checkpoint file {meta_file} ({e!r}); delete {path} to resume from the "
            f"previous checkpoint, or pass checkpoint.resume=never"
        ) from e
    return meta


def write_digests(folder: Path) -> None:
    """Write ``<folder>/sha256.json``: the SHA-256 of every other file of checkpoint ``folder``, atomically. A folder
    removed meanwhile (pruned by ``keep_last``) is left alone."""
    try:
        digests = {p.name: sha256_file(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != DIGEST_FILE}
        replace_own(folder / DIGEST_FILE, json.dumps(digests, indent=1) + "\n")
    except OSError:
        pass


def verify_digests(path: Path) -> None:
    """Check checkpoint ``path``'s files against its ``sha256.json`` (when it has one).

    Raises:
        ConfigError: a file listed there is missing or its SHA-256 differs (modified or corrupted since written).
    """
    try:
        digests = json.loads((path / DIGEST_FILE).read_text())
    except (OSError, ValueError):
        return
    for name, recorded in digests.items() if isinstance(digests, dict) else ():
        file = path / name
        actual = sha256_file(file) if file.is_file() else "missing"
        if actual != recorded:
            raise ConfigError(
                f"cannot resume from {path}: {file} was modified or corrupted after the checkpoint was "
                f"written ({'the file is missing' if actual == 'missing' else 'its SHA-256 differs'} "
                f"from {path / DIGEST_FILE}); delete {path} to fall back to the previous checkpoint, or "
                f"pass checkpoint.resume=never"
            )


def weights_sha256(job_dir: Path, at_end: bool, ema: Any, best: Any) -> dict[str, str]:
    """The SHA-256 of each weights file a run wrote into ``job_dir``, by its path there (``summary.json``
    ``weights_sha256``): ``model.safetensors``, ``model_ema.safetensors`` when ``ema`` is not None,
    ``best/model.safetensors`` when ``best`` is not None (checked by ``runner.track.records.check_weights``)."""
    names = ["model.safetensors", *(["model_ema.safetensors"] if ema is not None else [])] if at_end else []
    names += ["best/model.safetensors"] if best is not None else []
    return {name: sha256_file(job_dir / name) for name in names if (job_dir / name).is_file()}


# ------------------------------------------------------------------------------- loading safely
class SafeMetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` admitting only what it is made of: the classes of
    ``torch.distributed.checkpoint.metadata`` and the filesystem writer's ``_StorageInfo``, ``torch.Size``, dtypes,
    layouts and memory formats, paths, and plain containers. Any other global (``os.system``, ``builtins.eval``,
    a class with a ``__reduce__`` that runs code) raises ``RefusedPickle`` before it is called: the idea of
    ``torch.load(weights_only=True)``'s unpickler, for DCP's metadata classes."""

    _MODULES = ("torch.distributed.checkpoint.metadata",)
    _NAMES = {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "slice"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"),
        ("pathlib", "Path"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._NAMES:
            return super().find_class(module, name)
        if module in self._MODULES:
            found = super().find_class(module, name)
            if isinstance(found, type) and found.__module__ == module:
                return found
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise RefusedPickle(f"{module}.{name} is not part of a DCP checkpoint's metadata")


class RefusedPickle(pickle.UnpicklingError):
    """A pickle names a global outside ``SafeMetadataUnpickler``'s allowlist."""


def check_metadata(path: Path) -> Any:
    """Checkpoint ``path``'s ``.metadata``, unpickled through ``SafeMetadataUnpickler`` (DCP's ``Metadata``).

    Raises:
        ConfigError: the file holds anything but DCP's metadata (a planted pickle: "refusing to load", naming
            the file), or cannot be read at all (corrupt: "cannot resume from").
    """
    meta_file = Path(path) / ".metadata"
    try:
        with meta_file.open("rb") as f:
            return SafeMetadataUnpickler(f).load()
    except RefusedPickle as e:
        raise ConfigError(
            f"refusing to load {meta_file}: it is not plain DCP checkpoint metadata ({e}); a "
            f"checkpoint can carry code, so resume only checkpoints you or runner wrote. Delete "
            f"{path} or pass checkpoint.resume=never"
        ) from e
    except Exception as e:  # noqa: BLE001 - a damaged pickle fails in many ways (EOF, bad opcode, ...): one message
        raise ConfigError(
            f"cannot resume from {path}: its .metadata is corrupt ({type(e).__name__}: {e}); delete "
            f"{path} to fall back to the previous checkpoint, or pass checkpoint.resume=never"
        ) from e


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file-system reader, except that ``read_metadata`` unpickles through ``SafeMetadataUnpickler``: DCP's own
    reads ``.metadata`` with plain ``pickle.load``, so the file runner checked would be unpickled a second time,
    unchecked. The metadata checked up front (``check_metadata``, passed as ``metadata``) is the one DCP loads with."""

    def __init__(self, path: str | Path, metadata: Any = None):
        super().__init__(path)
        self._checked = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        rank = kwargs.get("rank")
        if rank is None and self._checked is not None:
            metadata = self._checked
        else:  # DCP's fallback to a rank's own __<rank>.metadata: through the same unpickler
            with self.fs.create_stream(self._get_metadata_path(rank), "rb") as f:
                metadata = SafeMetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as FileSystemReader.read_metadata does
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that a non-tensor item is unpickled with ``torch.load(weights_only=True)``
    (tensors, numbers, strings and plain containers) before DCP's own ``torch.load(weights_only=False)`` sees it.

    Raises:
        pickle.UnpicklingError: an item that holds anything else (turned into a ``ConfigError`` by
            ``Checkpointer.load``).
    """

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        data = value.read()
        torch.load(io.BytesIO(data), weights_only=True)  # raises on a global outside the weights-only allowlist
        super().load_bytes(read_item, io.BytesIO(data))


# ------------------------------------------------------------------------------- what is saved


class ModelAndOptimizer(Stateful):
    """The model and optimizer as DCP sees them: ``get_state_dict``/``set_state_dict`` handle plain modules,
    DDP (the ``module.`` prefix is dropped) and FSDP2 (DTensor shards, resharded on load), so the same
    checkpoint loads under another wrapper (https://pytorch.org/docs/stable/distributed.checkpoint.html).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer
        # a pipeline stage's optimizer groups hold other parameters than another stage's under the same keys
        # (param_groups.0.params): keyed by parameter name instead, as torchtitan does
        piped = getattr(model, "pipeline_stages", 1) > 1
        self.options = StateDictOptions(flatten_optimizer_state_dict=True) if piped else None

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self.options)
        return {"model": model_sd, "optimizer": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optimizer"],
            options=self.options,
        )


class RNGState(Stateful):
    """This rank's random-number generators (Python's, NumPy's, torch's CPU generator, the current CUDA device's),
    per rank (``rank<r>`` keys: ranks draw different augmentations and dropout). Plain data, so loading unpickles
    no code: Python's and NumPy's states as lists of ints, torch's as uint8 tensors."""

    def __init__(self, rank: int):
        self.rank = rank

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state = {
            "python": [version, list(internal), gauss],
            "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
            "torch": torch.get_rng_state().clone(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state().cpu()
        return {f"rank{self.rank}": state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = state_dict[f"rank{self.rank}"]
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(state["torch"].to(torch.uint8).cpu())
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"].to(torch.uint8).cpu())


def full_model_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights as plain, contiguous CPU tensors keyed without wrapper prefixes (``module.``,
    ``_orig_mod.``, checkpoint wrappers): FSDP2 and tensor-parallel shards are gathered (a collective: every rank
    calls it), rows that tensor parallelism regrouped put back in order (``model.tp_row_order``), a pipeline's
    stages gathered on rank 0 (``model.pipeline_stages``)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    piped = getattr(model, "pipeline_stages", 1) > 1  # each rank holds one stage (cpu_offload keeps rank 0's only)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=not piped))
    order = getattr(model, "tp_row_order", {})  # tensor parallelism regrouped these rows by rank: restored here
    state = {
        k: (v[order[k]] if k in order else v).detach().cpu().contiguous()
        for k, v in state.items()
        if isinstance(v, torch.Tensor)
    }
    if piped:  # rank 0 gets every stage's, in order
        stages = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(state, stages, dst=0)
        state = {k: v for stage in stages for k, v in stage.items()} if stages is not None else {}
    return state


def save_weights(model: torch.nn.Module, path: Path, is_main: bool) -> Path | None:
    """Write the trained weights as a plain state dict in safetensors format (loadable without runner:
    ``safetensors.torch.load_file(path)`` then ``model.load_state_dict``). Every rank must call it (FSDP
    gathers); rank 0 writes, atomically. Tied weights (one tensor under two names) are stored once each
    as a copy, since safetensors refuses shared storage. Returns the path on rank 0.

    Raises:
        ConfigError: the disk is full (the partial file removed, nothing left under ``path``'s name).
    """
    from safetensors.torch import save_file

    state = full_model_state_dict(model)
    if not is_main:
        return None
    seen: set[int] = set()
    plain = {}
    for name, tensor in state.items():
        ptr = tensor.untyped_storage().data_ptr()
        plain[name] = tensor.clone() if ptr in seen else tensor
        seen.add(ptr)
    tmp = path.with_suffix(".partial")
    tmp.unlink(missing_ok=True)  # a link planted there is removed, never written through
    try:
        save_file(plain, str(tmp), metadata={"format": "pt"})
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # safetensors creates 0600: the weights get a new file's usual mode
    except Exception as e:  # noqa: BLE001 - safetensors' own SafetensorError says "(os error 28)" for a full disk
        tmp.unlink(missing_ok=True)
        if write_failures.disk_full(e, path.parent) or "(os error 28)" in str(e):
            raise ConfigError(
                f"disk full while writing {path} ({write_failures.describe_free(path.parent)}); free "
                f"space there and run the same command with hydra.run.dir={path.parent} to finish from "
                f"the last checkpoint"
            ) from e
        raise
    tmp.replace(path)
    return path


# ------------------------------------------------------------------------------- the checkpointer


@dataclass
class Checkpointer:
    """Saves and restores the training state under ``<job_dir>/checkpoints`` on a schedule.

    Args:
        root: the ``checkpoints/`` folder of the job.
        every_steps: save after every this many optimizer steps (None: off).
        every_minutes: save when this much wall time passed since the last save (None: off). Ranks agree
            through the caller (``due`` is evaluated on rank 0's clock and broadcast by the engine).
        keep_last: complete checkpoints kept (older ones are deleted after each save); >= 1.
        async_save: write in a background thread after staging to CPU memory (``dcp.async_save``).
        is_main: rank 0 renames and prunes.
    """

    root: Path
    every_steps: int | None = None
    every_minutes: float | None = None
    keep_last: int = 2
    async_save: bool = False
    is_main: bool = True
    time_s: float = 0.0  # time the training loop was blocked by checkpointing (s), summed
    saves: int = 0
    _last_save: float = field(default_factory=time.monotonic)
    _pending: tuple[Future, Path, Path] | None = None
    _group: Any = None  # gloo group for async saves (NCCL stays free for training); None for one process
    _digesting: threading.Thread | None = None  # writes the newest checkpoint's sha256.json (rank 0)

    def due(self, step: int, now: float | None = None) -> bool:
        """Whether a checkpoint is due after optimizer ``step`` (by steps or by minutes)."""
        if self.every_steps and step % self.every_steps == 0:
            return True
        now = time.monotonic() if now is None else now
        return bool(self.every_minutes) and now - self._last_save >= self.every_minutes * 60

    def save(self, state: dict[str, Any], step: int, meta: dict[str, Any]) -> Path:
        """Write ``state`` (a dict of Stateful objects and plain values) as the checkpoint of ``step``.

        ``meta`` (JSON-serializable: config, world size, W&B run id, ...) goes to ``runner.json``. Returns
        the final folder (which exists once the write completes: at once when synchronous). Collective:
        every rank calls it with the same ``step``.
        """
        started = time.perf_counter()
        self.finish()  # one write in flight at a time
        final = self.root / step_name(step)
        partial = self.root / f".{step_name(step)}.partial"
        if self.is_main:
            shutil.rmtree(partial, ignore_errors=True)  # a leftover of a killed run
            with self._write_failures(partial):
                own_folder(self.root)  # a link planted at checkpoints/ would have runner prune its target
                partial.mkdir()
                write_own(partial / META_FILE, json.dumps({**meta, "step": step}, indent=2, default=str) + "\n")
        _barrier()
        if self.async_save:
            if self._group is None and dist.is_initialized() and dist.get_world_size() > 1:
                self._group = dist.new_group(backend="gloo")  # the write's collectives run off the main thread
            with self._write_failures(partial):
                future = dcp.async_save(
                    state, checkpoint_id=str(partial), process_group=self._group, no_dist=not dist.is_initialized()
                )
            self._pending = (future, partial, final)
        else:
            with self._write_failures(partial):
                dcp.save(state, checkpoint_id=str(partial), no_dist=not dist.is_initialized())
            self._publish(partial, final)
        self.time_s += time.perf_counter() - started
        self.saves += 1
        self._last_save = time.monotonic()
        return final

    def finish(self) -> None:
        """Wait for an asynchronous write in flight and publish it (rename, prune), and for the checksums of the
        newest checkpoint; a no-op otherwise."""
        self._wait_digests()
        if self._pending is None:
            return
        started = time.perf_counter()
        future, partial, final = self._pending
        self._pending = None
        with self._write_failures(partial):
            future.result()
        self._publish(partial, final)
        self.time_s += time.perf_counter() - started

    @contextlib.contextmanager
    def _write_failures(self, partial: Path):
        """Around a DCP write: on any failure the partial folder goes (the last complete checkpoint stays the
        newest); a full disk becomes one ``ConfigError`` saying so, and a second Ctrl-C (which DCP wraps in
        its ``CheckpointException``) a plain ``KeyboardInterrupt``; anything else is raised as it came."""
        try:
            yield
        except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException; each is re-raised
            if self.is_main:
                shutil.rmtree(partial, ignore_errors=True)
            if write_failures.interrupted(e):
                raise KeyboardInterrupt from e
            if write_failures.disk_full(e, self.root):
                kept = latest(self.root)
                raise ConfigError(
                    f"disk full while writing checkpoint {partial} ({write_failures.describe_free(self.root)}): the "
                    f"partial checkpoint was removed and "
                    + (f"the last complete one, {kept}, is kept" if kept else "there is no earlier checkpoint")
                    + "; free space there (or lower checkpoint.keep_last, or put hydra.run.dir on a larger disk) and "
                    "run the same command with hydra.run.dir=<this job folder> to resume"
                ) from e
            found = write_failures.unwritable(e, self.root)
            if found is not None:  # a read-only or foreign folder
                kept = latest(self.root)
                raise ConfigError(
                    f"{found[0]}: could not write checkpoint {partial}; "
                    + (f"the last complete checkpoint, {kept}, is kept" if kept else "there is no earlier checkpoint")
                    + f"; make {self.root} writable and run the same command with hydra.run.dir=<this job folder> "
                    f"to resume"
                ) from e
            raise

    def _publish(self, partial: Path, final: Path) -> None:
        if self.is_main:
            self._wait_digests()  # before pruning: the previous checkpoint's thread may still read its files
            if final.exists():  # the same step saved twice (e.g. the end-of-run save after a scheduled one)
                shutil.rmtree(final)
            partial.rename(final)
            for old in complete_checkpoints(self.root)[: -self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
            self._digesting = threading.Thread(target=write_digests, args=(final,), name="runner-checkpoint-sha256")
            self._digesting.start()

    def _wait_digests(self) -> None:
        if self._digesting is not None:
            self._digesting.join()
            self._digesting = None

    def load(self, state: dict[str, Any], path: Path) -> None:
        """Restore ``state`` in place from checkpoint ``path`` (every rank; shards are resharded as needed).

        Raises:
            ConfigError: the checkpoint cannot be read or does not match this model/optimizer (names the
                path and the likely cause).
        """
        reader = SafeFileSystemReader(str(path), check_metadata(path))  # .metadata read once, checked
        try:
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=not dist.is_initialized())
        except (Exception, dcp.CheckpointException) as e:  # noqa: BLE001 - CheckpointException is a BaseException
            # a refused global is an UnpicklingError (torch.load(weights_only=True)); the text of DCP's exception
            # holds tracebacks through the weights-only unpickler for any failure (a truncated file too)
            if any(isinstance(c, pickle.UnpicklingError) for c in write_failures.causes(e)):
                raise ConfigError(
                    f"refusing to load {path}: an item in its .distcp files is not plain tensors or "
                    f"numbers (a planted pickle?); a checkpoint can carry code, so resume only "
                    f"checkpoints you or runner wrote. Delete {path} or pass checkpoint.resume=never"
                ) from e
            lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
            why = lines[-1][:300] if lines else type(e).__name__  # DCP's exception ends with the rank's error
            raise ConfigError(
                f"cannot resume from {path}: {why}. The checkpoint is corrupt or was written by "
                f"another model/optimizer/world size; pass checkpoint.resume=never to start fresh, "
                f"or delete {path} to fall back to the previous checkpoint"
            ) from e


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
