"""W&B: an offline run inside the job folder holds the config, the ``perf/`` history and the summary.

The run is read back from its ``.wandb`` file: a LevelDB-log of ``wandb_internal_pb2.Record`` messages.
wandb 0.31 no longer ships a Python reader (``wandb.sdk.internal.datastore`` is gone; the Go core
writes the file), so ``read_records`` below implements the format: a 7-byte header (``:W&B``, magic
0xBEE1, version), then 32 KiB blocks of chunks, each ``crc32 (4) | length (2) | type (1) | data`` with
type FULL/FIRST/MIDDLE/LAST and the CRC the IEEE one seeded with the type byte.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Iterator

import pytest

from conftest import TINY, job_dirs, metrics_rows, read_summary, run_cli

_BLOCK, _CHUNK_HEADER = 32768, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def read_records(path: Path) -> Iterator:
    """Yield every ``Record`` of a ``run-*.wandb`` file, checking each chunk's CRC."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1), f"{path} is not a W&B transaction log"
    pos, pending = 7, b""
    while True:
        if _BLOCK - pos % _BLOCK < _CHUNK_HEADER:  # too little room left in the block: zero padding
            pos += _BLOCK - pos % _BLOCK
        if pos + _CHUNK_HEADER > len(data):
            return
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + _CHUNK_HEADER])
        chunk = data[pos + _CHUNK_HEADER : pos + _CHUNK_HEADER + length]
        pos += _CHUNK_HEADER + length
        if kind == 0:  # preallocated zeros at the end of a file still being written
            return
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"bad CRC at byte {pos} of {path}"
        pending = chunk if kind in (_FULL, _FIRST) else pending + chunk
        if kind in (_FULL, _LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            yield record


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def read_run(path: Path) -> dict:
    """The run's content: ``run`` (the RunRecord), ``config`` and ``summary`` (final values), ``history``
    (one dict per logged row), ``metrics`` (define_metric records) and ``exit`` (the ExitRecord or None)."""
    run, config, summary, history, metrics, exit_record = None, {}, {}, [], [], None
    for r in read_records(path):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            run = r.run
            config.update({_key(u): json.loads(u.value_json) for u in r.run.config.update})
        elif kind == "config":
            config.update({_key(u): json.loads(u.value_json) for u in r.config.update})
        elif kind == "summary":
            summary.update({_key(u): json.loads(u.value_json) for u in r.summary.update})
        elif kind == "history":
            history.append({_key(i): json.loads(i.value_json) for i in r.history.item})
        elif kind == "metric":
            metrics.append(r.metric)
        elif kind == "exit":
            exit_record = r.exit
    return {
        "run": run,
        "config": config,
        "summary": summary,
        "history": history,
        "metrics": metrics,
        "exit": exit_record,
    }


def wandb_files(root: Path) -> list[Path]:
    return sorted(root.rglob("run-*.wandb"))


@pytest.mark.cli
def test_offline_run_holds_config_history_and_summary(tmp_path):
    proc = run_cli(*TINY, "logger=wandb", "trainer.max_steps=6", "trainer.log_every=2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (job,) = job_dirs(tmp_path)
    (path,) = wandb_files(tmp_path)
    assert path.is_relative_to(job / "wandb"), path  # the W&B folder is inside the job folder
    assert not (tmp_path / "wandb").exists()
    run, summary = read_run(path), read_summary(job)

    assert run["run"].project == "runner"
    for key, value in summary["config"].items():  # the resolved config, every group
        assert run["config"][key] == value, key
    assert run["config"]["trainer"]["max_steps"] == 6

    rows = metrics_rows(job)
    timed = [(r["step"], r["samples_per_sec"]) for r in rows if r.get("samples_per_sec") is not None]
    logged = [(h["trainer/step"], h["perf/samples_per_sec"]) for h in run["history"] if "perf/samples_per_sec" in h]
    assert len(timed) >= 2 and logged == timed  # every metrics.jsonl figure, against trainer/step
    assert any("train/loss" in h for h in run["history"]) and any("eval/accuracy" in h for h in run["history"])
    assert all("trainer/step" in h for h in run["history"])
    assert any(m.glob_name == "*" and m.step_metric == "trainer/step" for m in run["metrics"])

    for key in (
        "samples_per_sec",
        "step_time_ms_median",
        "data_wait_fraction",
        "flops_per_sample",
        "eval_accuracy",
        "steps",
        "global_batch_size",
        "device",
    ):
        assert run["summary"][key] == summary[key], key
    assert run["summary"]["techniques"] == summary["techniques"] and "config" not in run["summary"]
    assert run["exit"] is not None and run["exit"].exit_code == 0


@pytest.mark.cli
def test_no_api_key_goes_offline_and_says_so_once_and_wandbs_start_up_lines_stay_off(tmp_path):
    """runner's one line says why the run is offline and how to upload it; W&B's own start-up lines ("wandb: W&B
    syncing is set to `offline`...", where the files are, `wandb leet`) are not printed (issue 38)."""
    home = tmp_path / "home"
    home.mkdir()  # no ~/.netrc, no wandb settings
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["HOME"] = str(home)  # no WANDB_SILENT, as a user runs it: only one sync hint in all the output
    proc = subprocess.run(
        [sys.executable, "-m", "runner", *TINY, "logger=wandb"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (job,) = job_dirs(tmp_path)
    (path,) = wandb_files(tmp_path)
    assert path.parent.name.startswith("offline-run-") and path.is_relative_to(job / "wandb")
    output = proc.stdout + proc.stderr
    assert output.count("wandb sync") == 1, output
    assert f"wandb sync {job}/wandb/offline-run-*" in proc.stdout
    assert [line for line in output.splitlines() if line.startswith("wandb:")] == [], output
    assert read_run(path)["exit"] is not None


@pytest.mark.cli
def test_a_key_from_wandb_login_and_no_network_fall_back_to_offline_at_once(tmp_path):
    """A key stored the way `wandb login` stores it (~/.netrc for the server's host) is found through wandb's
    own lookup; the server does not answer (a closed local port), so the run logs offline and says why,
    instead of stalling for wandb's 90 s init timeout and crashing."""
    home = tmp_path / "home"
    home.mkdir()
    (home / ".netrc").write_text(f"machine 127.0.0.1:9\n  login user\n  password {'k' * 40}\n")
    (home / ".netrc").chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env |= {"HOME": str(home), "WANDB_BASE_URL": "http://127.0.0.1:9"}  # port 9 (discard): nothing listens
    proc = subprocess.run(
        [sys.executable, "-m", "runner", *TINY, "logger=wandb"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "W&B: http://127.0.0.1:9 cannot be reached, logging offline" in proc.stdout
    assert "no API key" not in proc.stdout
    (path,) = wandb_files(tmp_path)
    assert path.parent.name.startswith("offline-run-")
    assert read_run(path)["exit"].exit_code == 0


def test_wandb_api_key_reads_the_login_file(tmp_path, monkeypatch):
    import wandb

    from runner.track import wandb_api_key

    wandb.teardown()  # wandb keeps its settings (the server URL) from an earlier use in this process

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert wandb_api_key() is None
    (tmp_path / "netrc").write_text(f"machine 127.0.0.1:9 login user password {'a' * 40}\n")
    assert wandb_api_key() == "a" * 40
