"""The compile cache (runner/techniques/compile_cache.py): compiled code loads only where it verifies as this user's.

A job leaves a signed ``compile_cache/`` in its folder; a resume in a new process with an empty Inductor cache (another
node) loads it and compiles in a fraction of the first run's time. A cache another user signed, one changed, added to
or linked after it was signed, or one whose cache keys leave the cache folder is never loaded: the job compiles cold
and says why. Kernels never reach Inductor's global cache folder, and a sweep's jobs share one signed cache.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT, TINY, read_summary
from runner.techniques import compile_cache


def _artifacts(*items: tuple[str, str, bytes]) -> bytes:
    """torch's portable artifacts format holding ``(kind, cache key, content)`` items, without compiling anything."""
    from torch.compiler._cache import CacheArtifactFactory, CacheArtifactManager, _serialize_single_cache
    from torch.utils._appending_byte_serializer import AppendingByteSerializer

    CacheArtifactManager._ensure_cache_artifacts_registered()
    out = AppendingByteSerializer(serialize_fn=_serialize_single_cache)
    by_kind: dict[str, list] = {}
    for kind, key, content in items:
        by_kind.setdefault(kind, []).append(CacheArtifactFactory.create(kind, key, content))
    out.extend(by_kind.items())
    return out.to_bytes()


KERNEL = "kernels/ab/cabcdefkernel.so"
#: The compiled jobs: an MLP, whose cold compile costs a core half the CNN's (~11 s against ~24 s on the CI machine)
COMPILED = ["compile=default", "model=mlp"]


def _entry(folder: Path, key: bytes, cache_key: str = "fabcdefgraph", content: bytes = b"graph") -> Path:
    compile_cache.write_entry(
        folder,
        {compile_cache.ARTIFACTS: _artifacts(("inductor", cache_key, content)), KERNEL: b"\x7fELF not really"},
        key,
    )
    return folder


@pytest.fixture
def key(tmp_path, monkeypatch) -> bytes:
    monkeypatch.setenv(compile_cache.KEY_ENV, str(tmp_path / "me" / "compile-cache.key"))
    return compile_cache.user_key(create=True)


def test_the_key_is_made_once_readable_by_its_owner_only(key, tmp_path):
    path = compile_cache.key_path()
    assert oct(path.stat().st_mode & 0o777) == "0o600" and compile_cache.user_key(create=False) == key
    path.chmod(0o644)  # readable by others: no cache is trusted until the user fixes it
    with pytest.raises(compile_cache.Refused, match="chmod 600"):
        compile_cache.user_key(create=False)
    path.unlink()
    path.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(compile_cache.Refused, match="link"):
        compile_cache.user_key(create=True)


def test_an_entry_of_yours_loads_its_kernels_into_this_process_s_own_folder(key, tmp_path):
    entry = _entry(tmp_path / "job" / compile_cache.FOLDER, key)
    status = compile_cache.load([entry])
    assert status.startswith(f"warm: loaded {entry} (1 artifacts, 1 kernels"), status
    own = compile_cache.isolate()
    assert (own / "ab" / "cabcdefkernel.so").read_bytes() == b"\x7fELF not really"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(own) and own.name.startswith("runner-inductor-")
    assert oct(own.stat().st_mode & 0o777) == "0o700"


def test_no_cache_is_cold_and_every_tampered_or_foreign_entry_is_refused(key, tmp_path, monkeypatch, capsys):
    assert compile_cache.load([tmp_path / "none"]) == "cold"
    cases = {}
    changed = _entry(tmp_path / "changed", key)
    (changed / KERNEL).write_bytes(b"\x7fELF planted")
    cases["changed"] = (changed, "changed after the entry was signed")
    added = _entry(tmp_path / "added", key)
    (added / "kernels" / "ab" / "cplanted.so").write_bytes(b"\x7fELF planted")
    cases["added"] = (added, "was added after the entry was signed")
    linked = _entry(tmp_path / "linked", key)
    (linked / KERNEL).unlink()
    (linked / KERNEL).symlink_to(tmp_path / "anything.so")
    cases["linked"] = (linked, "is a link")
    (tmp_path / "folder-link").symlink_to(_entry(tmp_path / "real", key))
    cases["folder link"] = (tmp_path / "folder-link", "is a link")
    cases["escaping key"] = (_entry(tmp_path / "escaping", key, cache_key="../../outside"), "leaves the cache folder")
    cases["absolute key"] = (_entry(tmp_path / "absolute", key, cache_key="/tmp/outside"), "absolute path")
    unsigned = tmp_path / "unsigned"
    shutil.copytree(_entry(tmp_path / "to-strip", key), unsigned)
    (unsigned / compile_cache.SIGNATURE).unlink()
    cases["unsigned"] = (unsigned, "carries no signature")
    monkeypatch.setenv(compile_cache.KEY_ENV, str(tmp_path / "colleague" / "compile-cache.key"))
    cases["another user's"] = (
        _entry(tmp_path / "colleague-cache", compile_cache.user_key(create=True)),
        "not signed with your key",
    )
    monkeypatch.setenv(compile_cache.KEY_ENV, str(tmp_path / "me" / "compile-cache.key"))
    for what, (entry, why) in cases.items():
        status = compile_cache.load([entry])
        assert status.startswith("cold: not loaded: ") and why in status, (what, status)
        assert "compile cache: not loaded, compiled here instead: " in capsys.readouterr().out, what
    planted = [p for p in compile_cache.isolate().rglob("*.so") if p.read_bytes() == b"\x7fELF planted"]
    assert not planted  # not one of their kernels was put where Inductor looks for them


def test_a_shared_folder_loads_the_entries_that_verify_and_names_the_others(key, tmp_path):
    shared = tmp_path / "sweep" / compile_cache.FOLDER
    _entry(shared / "job-1", key)
    _entry(shared / "job-2", key, cache_key="fsecondgraph")
    (shared / "job-2" / KERNEL).write_bytes(b"changed")
    status = compile_cache.load([tmp_path / "job" / compile_cache.FOLDER, shared])
    assert status.startswith(f"warm: loaded {shared / 'job-1'} ") and "refused 1: " in status, status


def test_a_job_writes_its_own_entry_and_a_shared_one_only_for_what_it_compiled(key, tmp_path, monkeypatch):
    import torch
    from torch.compiler._cache import CacheArtifactManager

    blob = _artifacts(("inductor", "fgraph", b"x"))
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (blob, None))
    monkeypatch.setattr(CacheArtifactManager, "need_serialize", lambda: True)
    misses = iter([5, 5, 7, 7])  # at the start (an earlier job's), at the first save, at the second; rank 1's
    monkeypatch.setattr(compile_cache, "cache_misses", lambda: next(misses))
    store = compile_cache.Store(tmp_path / "job", tmp_path / "shared")
    store.save()  # all found in the caches it loaded: its own entry only
    entry = tmp_path / "job" / compile_cache.FOLDER
    assert compile_cache.read_entry(entry, key)[compile_cache.ARTIFACTS] == blob and not (tmp_path / "shared").exists()
    blob = _artifacts(("inductor", "fgraph", b"x"), ("inductor", "fnew", b"y"))
    store.save()  # a graph of its own: a shared entry too
    (shared,) = (tmp_path / "shared").iterdir()
    assert compile_cache.read_entry(shared, key)[compile_cache.ARTIFACTS] == blob
    compile_cache.Store(tmp_path / "rank1", tmp_path / "shared1", is_main=False).save()  # rank > 0 writes nothing
    assert not (tmp_path / "rank1").exists() and not (tmp_path / "shared1").exists()


def test_a_folder_that_cannot_be_written_leaves_the_job_going(key, tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (_artifacts(("inductor", "f", b"x")), None))
    (tmp_path / "job").write_text("a file where the job folder would be")
    compile_cache.Store(tmp_path / "job", None).save()
    assert "compile cache: not written (" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------ real jobs


def _job(folder: Path, inductor: Path, *overrides: str, key: Path | None = None) -> tuple[dict, str]:
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(inductor),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO_ROOT),
        "WANDB_MODE": "disabled",
        **({compile_cache.KEY_ENV: str(key)} if key else {}),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "runner",
            *TINY,
            *COMPILED,
            "trainer.max_steps=6",
            "trainer.eval_every=6",
            f"hydra.run.dir={folder}",
            *overrides,
        ],
        cwd=folder.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_summary(folder), proc.stdout


def _planted_kernel(tmp_path: Path, marker: Path) -> bytes:
    """A shared library whose constructor writes ``marker``: what a colleague could put in a job folder."""
    source = tmp_path / "planted.c"
    source.write_text(
        "#include <stdio.h>\n__attribute__((constructor)) static void planted(void) "
        f'{{ FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n'
    )
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(tmp_path / "planted.so"), str(source)], check=True)
    return (tmp_path / "planted.so").read_bytes()


class _Payload:
    """A pickle that writes a file when it is loaded."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


@pytest.mark.slow
@pytest.mark.waits  # four jobs one after the other, each on one thread: beside the other tiers, not holding a worker
@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler to build the planted kernel")
def test_your_cache_resumes_warm_and_a_colleague_s_planted_code_never_runs(tmp_path):
    """The first run compiles cold in its own Inductor folder (the 'global' one stays empty) and leaves a signed
    compile_cache/; a resume from its checkpoint on another node loads it and compiles in under half the time. A
    colleague's folder holding planted kernels and a crafted artifacts.bin (pickles, an absolute cache key), signed
    with their own key, resumed by you, compiles cold: no kernel constructor and no pickle runs, nothing is written
    outside, and nothing reaches the global folder."""
    mine = tmp_path / "me.key"
    first, _ = _job(tmp_path / "job", tmp_path / "global", key=mine)
    assert first["one_time"]["compile_cache"] == "cold" and first["one_time"]["compile_s"] > 0
    assert first["one_time"]["graph_breaks"] == 0
    assert not list((tmp_path / "global").rglob("*.so")), "a kernel went into the global Inductor folder"
    (checkpoint,) = (tmp_path / "job" / "checkpoints").glob("step_*")
    again, _ = _job(
        tmp_path / "resumed", tmp_path / "global", "trainer.max_steps=9", f"checkpoint.resume={checkpoint}", key=mine
    )
    once = again["one_time"]
    assert once["compile_cache"].startswith(f"warm: loaded {tmp_path / 'job' / 'compile_cache'} ")
    assert again["steps"] == 9
    assert once["compile_s"] < 0.5 * first["one_time"]["compile_s"], (once, first["one_time"])

    colleague = tmp_path / "colleague"  # their job folder (a copy of a real run's), kernels and pickles planted,
    shutil.copytree(tmp_path / "job", colleague)  # signed with their own key (a run of theirs compiled the same)
    (tmp_path / "theirs.key").write_bytes(os.urandom(32))
    marker, outside = tmp_path / "kernel-ran", tmp_path / "written-outside"
    planted = _planted_kernel(tmp_path, marker)
    files = {name: planted for name in compile_cache._files_in(colleague / "compile_cache") if name.endswith(".so")}
    payload = pickle.dumps(_Payload(tmp_path / "pickled"))
    files[compile_cache.ARTIFACTS] = _artifacts(("inductor", str(outside), payload))
    compile_cache.write_entry(colleague / "compile_cache", files, (tmp_path / "theirs.key").read_bytes())
    (theirs,) = (colleague / "checkpoints").glob("step_*")
    # from their checkpoint into a folder of yours, then in their folder (which then holds your cache: last)
    for folder, how in (
        (tmp_path / "mine", ["trainer.max_steps=9", f"checkpoint.resume={theirs}"]),
        (colleague, ["trainer.max_steps=9"]),
    ):
        summary, out = _job(folder, tmp_path / "global", *how, key=mine)
        assert summary["one_time"]["compile_cache"].startswith("cold: not loaded: ") and summary["steps"] == 9
        assert "not signed with your key" in out
    assert not marker.exists() and not (tmp_path / "pickled").exists() and not outside.exists()
    assert not list((tmp_path / "global").rglob("*.so"))


@pytest.mark.cli
def test_a_compiled_sweep_compiles_once(tmp_path):
    """Four jobs of one model in a multirun: the first compiles, the others find its graphs (in the sweep's shared
    cache and the process's own folder) and compile in under a quarter of its time; each summary says what it
    loaded."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT), "WANDB_MODE": "disabled"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "runner",
            "-m",
            *TINY,
            *COMPILED,
            "trainer.max_steps=3",
            "optimizer.lr=0.01,0.02,0.03,0.04",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    once = [read_summary(tmp_path / "sweep" / str(i))["one_time"] for i in range(4)]
    assert once[0]["compile_cache"] == "cold", once[0]
    for later in once[1:]:
        assert later["compile_cache"].startswith(f"warm: loaded {tmp_path / 'sweep' / 'compile_cache'}/"), later
        assert later["compile_s"] < 0.25 * once[0]["compile_s"], [o["compile_s"] for o in once]
    assert len(list((tmp_path / "sweep" / "compile_cache").iterdir())) == 1  # one entry: only the first compiled
