"""Compiled code that runs only where it is your own: the compile cache of a job, of a sweep and of a tuned preset.

torch.compile's caches hold code: Inductor's FX-graph and AOTAutograd entries are pickles, and a CPU job's kernels
are shared libraries (``.so``) whose constructors run as they load. So runner

- compiles every process against a cache folder of its own (``isolate``: a new ``TORCHINDUCTOR_CACHE_DIR`` and
  ``TRITON_CACHE_DIR``, mode 0700, removed at exit), never Inductor's global one (``/tmp/torchinductor_<user>``): a
  kernel of one job cannot reach another;
- writes what a job compiled as a signed entry (``Store.save``): torch's portable cache artifacts
  (``torch.compiler.save_cache_artifacts``, PyTorch recipe "Compile Time Caching in torch.compile") and the C++
  kernels they leave out, each file's SHA-256 in ``signature.json`` under an HMAC-SHA256 keyed by a secret of this
  user (``user_key``: made on first use, 0600, ``$XDG_CONFIG_HOME/runner/compile-cache.key``);
- loads an entry (``load``) only when that signature verifies, no file was added, changed or linked, the same torch
  wrote it and no cache key in it is an absolute path or leaves the cache folder, and then hands torch the bytes it
  checked, never a path. Anything else compiles cold and says why (``summary.json`` ``one_time.compile_cache``).

Where entries live: ``<job>/compile_cache/`` (the job's own; a resume from its folder or checkpoint on any node
loads it) and a shared folder of entries (``shared_folder``: ``compile.cache``, else a multirun's
``<sweep>/compile_cache/``; the speed tuner's preset names one) that each job loads and adds to when it compiled
something the folder did not hold. The trust rule and its reasons: docs/configuration.md, "The compile cache".
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import shutil
import socket
import stat
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from runner.files import replace_own, write_own

FOLDER = "compile_cache"  # in a job folder: one entry; in a sweep folder or a preset's: a folder of entries
SIGNATURE = "signature.json"  # {"format", "torch", "files": {relative path: sha256}, "mac"}
ARTIFACTS = "artifacts.bin"  # torch's portable cache artifacts
KEY_ENV = "RUNNER_COMPILE_CACHE_KEY"  # the key file, where not $XDG_CONFIG_HOME/runner/compile-cache.key
FORMAT = 1
#: the files an entry may hold besides its signature: the artifacts and kernels named as Inductor names them
_KERNEL = re.compile(r"kernels/[a-z0-9]{2}/[A-Za-z0-9_]+(\.main)?\.so")
#: a cache key torch may write under its cache folder: relative, no ``..``, plain characters
_CACHE_KEY = re.compile(r"[A-Za-z0-9_\-:]+(\.[A-Za-z0-9_\-:]+)*(/[A-Za-z0-9_\-:]+(\.[A-Za-z0-9_\-:]+)*)*")


class Refused(Exception):
    """Why a compile cache is not loaded (or not written): one line for the console and ``summary.json``."""


# ------------------------------------------------------------------------------------------------ the process's folder

_OWN: tuple[int, Path] | None = None  # (pid, folder): this process's Inductor cache folder


def isolate() -> Path:
    """This process's own Inductor and Triton cache folder (made empty, 0700, on the first call in each process;
    removed when the process ends), set as ``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR`` so that nothing
    compiled elsewhere is found and nothing compiled here is left for another job. Call before the first compile."""
    global _OWN
    if _OWN is not None and _OWN[0] == os.getpid() and os.environ.get("TORCHINDUCTOR_CACHE_DIR") == str(_OWN[1]):
        return _OWN[1]
    from multiprocessing import util

    folder = Path(tempfile.mkdtemp(prefix="runner-inductor-"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    os.environ["TRITON_CACHE_DIR"] = str(folder / "triton")
    if _OWN is not None or "torch._inductor.codecache" in sys.modules:  # forget the paths Inductor memoized
        from torch._inductor.utils import clear_caches

        clear_caches()
    _OWN = (os.getpid(), folder)
    # multiprocessing's exit hook runs in the main process (atexit) and in a job forked by the job server (which
    # exits through os._exit, skipping atexit), and forgets a parent's hooks in a child
    util.Finalize(None, shutil.rmtree, args=(str(folder),), kwargs={"ignore_errors": True}, exitpriority=0)
    return folder


# ------------------------------------------------------------------------------------------------ the key


def key_path() -> Path:
    """Where this user's signing key lives: ``$RUNNER_COMPILE_CACHE_KEY``, else
    ``$XDG_CONFIG_HOME/runner/compile-cache.key`` (``~/.config/...``). On a cluster with a shared home, every node
    reads the same key, so a cache written on one node loads on the others."""
    if os.environ.get(KEY_ENV):
        return Path(os.environ[KEY_ENV]).expanduser()
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "runner" / "compile-cache.key"


def user_key(create: bool) -> bytes:
    """This user's 32-byte signing key, made (``create``) where there is none.

    Raises:
        Refused: no key and not ``create``; a key file that is a link, not this user's, readable by others, or short.
    """
    path = key_path()
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        if not create:
            raise Refused(f"there is no key at {path}: nothing here was signed by you") from None
        return _new_key(path)
    except OSError as e:
        raise Refused(f"the key {path} cannot be read ({e.strerror}; a link is not followed)") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise Refused(
                f"the key {path} must be a file of yours that only you can read (chmod 600 {path}); "
                f"until it is, no compile cache is trusted"
            )
        secret = f.read()
    if len(secret) < 32:
        raise Refused(
            f"the key {path} holds {len(secret)} bytes, not a key: remove it (the next compiled job makes a "
            f"new one; caches signed with the old one then compile cold)"
        )
    return secret


def _new_key(path: Path) -> bytes:
    """A new key at ``path``, written whole before it appears (a linked temporary file): two processes making one at
    once both end up reading the first."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(32))
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return user_key(create=False)


def _mac(body: dict, key: bytes) -> str:
    return hmac.new(key, json.dumps(body, sort_keys=True, separators=(",", ":")).encode(), hashlib.sha256).hexdigest()


# ------------------------------------------------------------------------------------------------ reading an entry


def _read_own(path: Path) -> bytes:
    """The bytes of the plain file ``path``, never through a link."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        raise Refused(f"{path} cannot be read ({e.strerror}; a link is not followed)") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise Refused(f"{path} is not a plain file")
        return f.read()


def _files_in(entry: Path) -> set[str]:
    """Every file under ``entry``, relative; a link or anything but folders and plain files is refused."""
    if not stat.S_ISDIR(os.lstat(entry).st_mode):
        raise Refused(f"{entry} is a link or not a folder")
    found = set()
    for parent, folders, files in os.walk(entry):
        for name in folders + files:
            mode = os.lstat(Path(parent) / name).st_mode
            if stat.S_ISLNK(mode) or not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                raise Refused(f"{Path(parent) / name} is a link or not a plain file")
            if stat.S_ISREG(mode):
                found.add((Path(parent) / name).relative_to(entry).as_posix())
    return found


def read_entry(entry: Path, key: bytes) -> dict[str, bytes]:
    """The files of the signed entry ``entry`` (relative path -> bytes), each checked against its signature.

    Raises:
        Refused: a signature that does not verify with ``key`` (another user's cache, or one changed since),
            a file added, changed or linked, another torch's cache, a file name no entry holds.
    """
    found = _files_in(entry)
    if SIGNATURE not in found:
        raise Refused(f"{entry} carries no signature (another's cache, or written before runner signed them)")
    try:
        signed = json.loads(_read_own(entry / SIGNATURE))
        mac, body = signed.pop("mac"), signed
        listed = dict(body["files"])
    except (ValueError, KeyError, TypeError, AttributeError):
        raise Refused(f"{entry / SIGNATURE} is not a signature runner wrote") from None
    if not isinstance(mac, str) or not hmac.compare_digest(mac, _mac(body, key)):
        raise Refused(f"{entry} is not signed with your key (another user's cache, or changed since it was written)")
    if body.get("torch") != torch.__version__:
        raise Refused(f"{entry} was compiled by torch {body.get('torch')}; this is torch {torch.__version__}")
    if added := sorted(found - set(listed) - {SIGNATURE}):
        raise Refused(f"{entry / added[0]} was added after the entry was signed")
    out = {}
    for name, digest in listed.items():
        if name != ARTIFACTS and not _KERNEL.fullmatch(name):
            raise Refused(f"{entry}: {name!r} is not a file a compile cache holds")
        out[name] = _read_own(entry / name)
        if hashlib.sha256(out[name]).hexdigest() != digest:
            raise Refused(f"{entry / name} changed after the entry was signed")
    if ARTIFACTS not in out:
        raise Refused(f"{entry} holds no {ARTIFACTS}")
    return out


def safe_cache_key(key: str) -> bool:
    """Whether torch may write the cache key ``key`` under its cache folder: relative and inside it."""
    return bool(_CACHE_KEY.fullmatch(key)) and ".." not in key


def _install(files: dict[str, bytes]) -> tuple[int, int]:
    """Put a checked entry's bytes in this process's caches: the kernels into its own Inductor folder (``isolate``),
    then the artifacts (torch writes each under its cache key). Returns (artifacts, kernels written).

    Raises:
        Refused: bytes that are not torch's artifacts, or a cache key that is absolute or leaves the cache folder.
    """
    from torch.compiler._cache import CacheArtifactManager

    artifacts = CacheArtifactManager.deserialize(files[ARTIFACTS])  # torch's own byte format: nothing is unpickled
    if not artifacts:
        raise Refused("its artifacts.bin is not torch's cache artifacts")
    keys = [a.key for kind in artifacts.values() for a in kind]
    if bad := [k for k in keys if not safe_cache_key(k)]:
        raise Refused(f"its cache key {bad[0]!r} is an absolute path or leaves the cache folder")
    folder, kernels = isolate(), 0
    for name, data in files.items():
        target = folder / name.removeprefix("kernels/")
        if name != ARTIFACTS and not target.exists():
            target.parent.mkdir(exist_ok=True)
            replace_own(target, data)
            kernels += 1
    CacheArtifactManager.populate_caches(artifacts)
    return len(keys), kernels


def entries(source: Path) -> list[Path]:
    """The entries of a cache folder: the folder itself when it is one (a job's), else its entries (a shared
    folder's), oldest first; [] when there is nothing there."""
    if source.is_symlink() or any(os.path.lexists(source / name) for name in (SIGNATURE, ARTIFACTS)):
        return [source]
    if not source.is_dir():
        return []
    found = [p for p in source.iterdir() if not p.name.startswith(".") and (p.is_symlink() or p.is_dir())]
    return sorted(found, key=lambda p: (p.lstat().st_mtime, p.name))


def load(sources: list[Path]) -> str:
    """Load every entry of ``sources`` (cache folders: a job's ``compile_cache/``, a shared folder) that verifies as
    yours (``read_entry``, ``_install``) into this process's caches, before its first compile. Returns what
    happened, for ``summary.json``'s ``one_time.compile_cache``: ``cold`` (nothing to load), ``cold: <why>`` (nothing
    loaded; the first refusal), or ``warm: loaded ...`` (with what was refused, if any); a refusal is also printed."""
    found = [e for s in sources for e in entries(Path(s))]
    if not found:
        return "cold"
    loaded, refused = [], []
    try:
        key = user_key(create=False)
    except Refused as e:
        refused = [f"{found[0]}: {e}"]
    else:
        for entry in found:
            try:
                files = read_entry(entry, key)
                n, kernels = _install(files)
                loaded.append((entry, n, kernels, sum(len(b) for b in files.values())))
            except (Refused, OSError) as e:
                refused.append(str(e) if isinstance(e, Refused) else f"{entry}: {type(e).__name__}: {e}")
    if refused:
        print(
            f"compile cache: not loaded, compiled here instead: {refused[0]}"
            + (f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""),
            flush=True,
        )
    if not loaded:
        return f"cold: not loaded: {refused[0]}"
    said = ", ".join(f"{e} ({n} artifacts, {k} kernels, {size / 2**20:.2f} MiB)" for e, n, k, size in loaded[:3])
    more = f" and {len(loaded) - 3} more entries" if len(loaded) > 3 else ""
    return f"warm: loaded {said}{more}" + (f"; refused {len(refused)}: {refused[0]}" if refused else "")


# ------------------------------------------------------------------------------------------------ writing


def _own_kernels() -> dict[str, bytes]:
    """The C++ libraries (``.so``) in this process's Inductor folder, as an entry names them (``kernels/<xy>/...``):
    each graph's own and the shared ones every graph links (most of a small job's cold compile); {} where that
    layout is not found."""
    folder = isolate()
    out = {}
    for so in folder.glob("*/*.so"):
        name = f"kernels/{so.parent.name}/{so.name}"
        if _KERNEL.fullmatch(name) and not so.is_symlink():
            out[name] = so.read_bytes()
    return out


def write_entry(entry: Path, files: dict[str, bytes], key: bytes) -> None:
    """Write ``files`` as the signed entry ``entry``: into a new hidden folder beside it, signature last, then renamed
    into place (an entry that was there, or a link, is replaced; never written through)."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    try:
        for name, data in files.items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            write_own(tmp / name, data)
        body = {
            "format": FORMAT,
            "torch": torch.__version__,
            "files": {name: hashlib.sha256(data).hexdigest() for name, data in files.items()},
        }
        write_own(tmp / SIGNATURE, json.dumps({**body, "mac": _mac(body, key)}, indent=1))
        old = None
        if entry.is_symlink() or entry.is_file():
            entry.unlink()
        elif entry.exists():
            old = entry.with_name(f".{entry.name}.{os.getpid()}.old")
            os.replace(entry, old)
        os.replace(tmp, entry)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def cache_misses() -> int:
    """Graphs this process compiled rather than found in a cache (Inductor's and AOTAutograd's misses)."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_miss"] + counters["aot_autograd"]["autograd_cache_miss"]


@dataclass
class Store:
    """Where one compiled job writes its compiled code (``save``): its own entry ``<job_dir>/compile_cache`` (rank 0;
    None: none) and, when it compiled something new, an entry of its own in the shared folder ``shared``."""

    job_dir: Path | None
    shared: Path | None
    is_main: bool = True
    _written: str = ""  # the SHA-256 of the artifacts last written (nothing new: nothing to write)
    _misses: int = -1  # cache_misses() at the last shared entry (at the start: what earlier jobs compiled)
    _entry: Path | None = None  # this process's entry in the shared folder
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self._misses < 0:
            self._misses = cache_misses()

    def save(self) -> None:
        """Write what this process compiled so far, when it changed since the last call (cheap otherwise: a
        comparison's job calls it at every pause). A key or folder that cannot be written is noted once and
        skipped: the job goes on (its next run compiles cold)."""
        from torch.compiler._cache import CacheArtifactManager

        if not self.is_main or (self._written and not CacheArtifactManager.need_serialize()):
            return
        artifacts = torch.compiler.save_cache_artifacts()
        if not artifacts or not artifacts[0]:
            return
        digest = hashlib.sha256(artifacts[0]).hexdigest()
        if digest == self._written:
            return
        try:
            key = user_key(create=True)
            files = {ARTIFACTS: artifacts[0], **_own_kernels()}
            if self.job_dir is not None:
                write_entry(Path(self.job_dir) / FOLDER, files, key)
            misses = cache_misses()
            if self.shared is not None and misses > self._misses:
                entry = Path(self.shared) / f"{socket.gethostname()}-{os.getpid()}-{digest[:12]}"
                write_entry(entry, files, key)
                if self._entry is not None and self._entry != entry:  # this process's earlier entry: a subset
                    shutil.rmtree(self._entry, ignore_errors=True)
                self._entry, self._misses = entry, misses
        except (Refused, OSError) as e:
            if not self.notes:
                print(f"compile cache: not written ({e}); the next run compiles cold", flush=True)
            self.notes.append(str(e))
            return
        self._written = digest


def shared_folder(cfg) -> Path | None:
    """The shared cache folder of a compiled job's config ``cfg``: ``compile.cache`` when set, else in a multirun
    ``<sweep dir>/compile_cache`` (every job of the sweep shares it), else None."""
    mine = cfg.compile.get("cache")
    if mine:
        return Path(str(mine)).expanduser().absolute()
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        return Path(HydraConfig.get().sweep.dir).absolute() / FOLDER
    return None


def compiled_so_far() -> tuple[float, int, int]:
    """torch.compile's wall seconds, graphs compiled and graph breaks in this process so far (recompiles included)."""
    from torch._dynamo.utils import calculate_time_spent, counters

    return (
        calculate_time_spent().get("total_wall_time", 0.0),
        counters["stats"]["unique_graphs"],
        sum(counters["graph_break"].values()),
    )


def graph_break_reasons(limit: int = 3) -> list[str]:
    """The most frequent reasons dynamo broke a graph in this process (``TORCH_LOGS=graph_breaks`` gives all)."""
    from torch._dynamo.utils import counters

    return [reason.splitlines()[0][:160] for reason, _ in counters["graph_break"].most_common(limit)]


def copy_entry(source: Path, target: Path) -> str | None:
    """Copy the entry ``source`` to ``target`` (e.g. the speed tuner's pick beside its preset), checked as yours
    first; None, or why it was not copied."""
    try:
        write_entry(target, read_entry(source, user_key(create=False)), user_key(create=False))
    except (Refused, OSError) as e:
        return str(e)
    return None
