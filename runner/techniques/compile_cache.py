"""The compile cache travels with the job: torch's portable cache artifacts and the kernels in ``<job>/compile_cache/``.

``torch.compiler.save_cache_artifacts`` packs what Inductor and AOTAutograd compiled in this process (torch >= 2.7;
PyTorch recipe "Compile Time Caching in torch.compile", https://pytorch.org/tutorials/recipes/torch_compile_caching_tutorial.html);
``load_cache_artifacts`` fills this process's caches before the first compile, so a resumed, requeued or rerun job
on another node (an empty ``TORCHINDUCTOR_CACHE_DIR``) hits instead of compiling. The artifacts are compiled code:
runner loads them only from the job folder it continues, never in evaluate or export.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import torch

from runner.track.records import open_own

FOLDER = "compile_cache"  # artifacts.bin (torch's portable artifacts) and kernels/ (the C++ kernels a CPU job built)


def load(job_dir: Path) -> str:
    """Load ``<job_dir>/compile_cache/`` into torch's compile caches: the kernels into Inductor's cache folder (where
    it has none of that name), then the artifacts. Returns what happened, for ``summary.json``'s
    ``one_time.compile_cache`` (``cold``: nothing to load, or a cache that does not load)."""
    folder = Path(job_dir) / FOLDER
    path = folder / "artifacts.bin"
    if folder.is_symlink() or path.is_symlink() or not path.is_file():
        return "cold"
    blob = path.read_bytes()
    try:
        if torch.compiler.load_cache_artifacts(blob) is None:  # torch's answer to bytes that are no artifacts
            return f"cold: {path} did not load (not torch's cache artifacts)"
        kernels = _put_kernels(folder / "kernels")
    except Exception as e:  # noqa: BLE001 - another torch's or a damaged cache: compile from scratch
        return f"cold: {folder} did not load ({type(e).__name__}: {str(e)[:120]})"
    return (f"warm: loaded {folder} ({len(blob) / 2**20:.2f} MiB of artifacts, sha256 "
            f"{hashlib.sha256(blob).hexdigest()[:12]}; {kernels} kernels)")


def compiled_so_far() -> tuple[float, int]:
    """torch.compile's wall seconds and graphs compiled in this process so far (recompiles included)."""
    from torch._dynamo.utils import calculate_time_spent, counters

    return calculate_time_spent().get("total_wall_time", 0.0), counters["stats"]["unique_graphs"]


def save(job_dir: Path, is_main: bool) -> None:
    """Write what this process compiled to ``<job_dir>/compile_cache/`` (rank 0; never through a link): torch's
    portable artifacts, atomically, and the C++ kernels Inductor built or loaded for it, which the artifacts leave
    out (on a CPU their build is most of a cold compile). Nothing is written when nothing was compiled."""
    artifacts = torch.compiler.save_cache_artifacts() if is_main else None
    if not artifacts or not artifacts[0]:
        return
    folder = Path(job_dir) / FOLDER
    if folder.is_symlink():
        folder.unlink()
    (folder / "kernels").mkdir(parents=True, exist_ok=True)
    for so in _own_kernels():
        target = folder / "kernels" / so.parent.name / so.name
        if not target.exists():
            target.parent.mkdir(exist_ok=True)
            shutil.copyfile(so, target)
    tmp = folder / "artifacts.bin.tmp"
    with open_own(tmp, "wb") as f:
        f.write(artifacts[0])
    os.replace(tmp, folder / "artifacts.bin")


def _own_kernels() -> list[Path]:
    """The C++ libraries (``.so``) this process's compiled graphs use, in Inductor's cache folder: each graph's own (its
    code caches are keyed by the hash that names the file, ``<cache>/<key[1:3]>/<key>.main.so``) and the shared ones
    every graph links (no ``.main``: built once per cache folder, most of a small job's cold compile); [] where that
    layout is not found."""
    try:
        from torch._inductor import codecache
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        keys = [k for c in (codecache.CppCodeCache, codecache.CppPythonBindingsCodeCache,
                            codecache.CppWrapperCodeCache) for k in c.cache]
        shared = [so for so in Path(cache_dir()).glob("*/*.so") if ".main." not in so.name] if keys else []
        return [so for k in keys for so in (Path(cache_dir()) / k[1:3]).glob(f"{k}*.so")] + shared
    except Exception:  # noqa: BLE001 - torch's private layout moved: the artifacts alone still help
        return []


def _put_kernels(kernels: Path) -> int:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    count = 0
    for so in kernels.glob("*/*.so") if kernels.is_dir() and not kernels.is_symlink() else []:
        target = Path(cache_dir()) / so.parent.name / so.name
        if not so.is_symlink() and not target.exists():  # copied whole, then renamed: ranks may load side by side
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(so, target.with_name(f"{so.name}.{os.getpid()}.tmp"))
            os.replace(target.with_name(f"{so.name}.{os.getpid()}.tmp"), target)
            count += 1
    return count
