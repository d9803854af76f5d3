"""runner writes every file of a job, sweep or tuner folder through runner/files.py, never through a link."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import pytest

from conftest import TINY_GPT, TINY_LOOP, make_tiny_text, read_summary, run_tiny

RUNNER = Path(__file__).resolve().parent.parent / "runner"
#: A raw write: ``write_text``/``write_bytes``, ``open(..., "w"|"a"|"x")``, ``Path.open("w")``, numpy's ``tofile``,
#: matplotlib's ``savefig`` to a path, ``shutil.copy*``
RAW_WRITE = re.compile(
    r"\.write_(text|bytes)\(|\bopen\([^)]*[\"'][wax]b?\+?[\"']|\.open\([\"'][wax]|\.tofile\("
    r"|\.savefig\((?!f\b)|shutil\.copy(file)?\("
)
#: The writes that are not to a folder a user can share: the kernel's own file
ALLOWED = {("measure/__init__.py", 'Path("/proc/self/clear_refs").write_text("5")')}


def test_runner_writes_no_file_but_through_runner_files():
    """Every write site in runner/ goes through ``runner.files`` (open_own, write_own, replace_own), which removes a
    link planted at the name instead of writing through it: a new write site that opens a path directly fails here."""
    raw = {
        (str(p.relative_to(RUNNER)), line.strip())
        for p in RUNNER.rglob("*.py")
        if p.name != "files.py"
        for line in p.read_text().splitlines()
        if RAW_WRITE.search(line) and not line.lstrip().startswith("#")
    }
    assert raw - ALLOWED == set(), sorted(raw - ALLOWED)


def test_links_planted_at_a_job_s_write_sites_leave_their_targets_unchanged(tmp_path):
    """A colleague's job folder, continued: links planted at the metrics' and the CSV logger's temporary files, the
    metrics file itself (appended to), the vocabulary, the generated sample and the restart count's temporary file
    are replaced by files of the job's own, and the file they pointed at (a stand-in ``~/.bashrc``) is unchanged."""
    victim = tmp_path / "bashrc"
    victim.write_text("precious\n")
    job = tmp_path / "job"
    text = make_tiny_text(tmp_path / "tiny.txt")
    common = [*TINY_LOOP, *TINY_GPT, f"data.path={text}", "logger=csv", "checkpoint.every_steps=2"]
    run_tiny(job, *common)
    sites = [
        "metrics.jsonl",
        "metrics.jsonl.tmp",
        "metrics.csv.tmp",
        "vocab.json",
        "vocab.json.tmp",
        "samples.txt",
        "restarts.json.tmp",
    ]
    for name in sites:
        (job / name).unlink(missing_ok=True)
        (job / name).symlink_to(victim)
    summary = run_tiny(job, *common, "trainer.max_steps=8")  # continues the job from its step-4 checkpoint
    assert summary["steps"] == 8
    assert victim.read_text() == "precious\n"
    for name in ("metrics.jsonl", "vocab.json", "samples.txt"):
        assert (job / name).is_file() and not (job / name).is_symlink(), name
    assert not any((job / name).is_symlink() for name in sites)


def test_links_planted_at_a_job_s_folders_leave_their_targets_unchanged(tmp_path):
    """``checkpoints/``, ``best/`` and ``tensorboard/`` planted as links to a folder of someone's: the run makes
    folders of its own there, so its pruning (``checkpoint.keep_last=1``) and writes never touch the target."""
    victim = tmp_path / "victim"
    (victim / "step_00000001").mkdir(parents=True)
    (victim / "step_00000001" / "data").write_text("precious\n")
    job = tmp_path / "job"
    job.mkdir()
    for name in ("checkpoints", "best", "tensorboard"):
        (job / name).symlink_to(victim, target_is_directory=True)
    summary = run_tiny(
        job,
        *TINY_LOOP,
        "checkpoint.every_steps=2",
        "checkpoint.keep_last=1",
        "checkpoint.keep_best=true",
        "trainer.eval_every=2",
        "logger=tensorboard",
    )
    assert summary["steps"] == 4
    assert sorted(p.name for p in victim.rglob("*")) == ["data", "step_00000001"]
    for name in ("checkpoints", "best", "tensorboard"):
        assert (job / name).is_dir() and not (job / name).is_symlink() and any((job / name).iterdir()), name


def test_the_restart_pointer_lives_in_a_private_folder(tmp_path, monkeypatch):
    """torchrun's restart pointer (the job folder a restarted worker resumes in) is in a temp folder of the user's
    own: a folder of that name open to others, or a link, is refused with one message, since another user's pointer
    there would choose the folder a restart writes into."""
    from runner import launch
    from runner.errors import ConfigError

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    env = {"TORCHELASTIC_RUN_ID": "job/1", "RANK": "0"}
    pointer = launch.elastic_pointer(env)
    assert pointer == tmp_path / f"runner-elastic-{os.getuid()}" / "job_1.jobdir"
    assert (pointer.parent.stat().st_mode & 0o777) == 0o700
    pointer.parent.chmod(0o777)
    with pytest.raises(ConfigError, match="not a private folder of yours"):
        launch.elastic_pointer(env)


def test_two_runs_started_in_the_same_second_get_a_folder_each(tmp_path):
    """Hydra's run folder is ``outputs/<date>/<time>``, to the second: the second run of that second (it found the
    folder made) gets ``<time>-2``, the third ``<time>-3``, each made by the run that claims it."""
    from runner.engine import jobdir

    dated = tmp_path / "outputs" / "2026-12-06" / "16-40-01"
    first = jobdir._new_folder(dated, remember=False)
    second = jobdir._new_folder(dated, remember=False)
    third = jobdir._new_folder(dated, remember=False)
    assert (first, second, third) == (dated, dated.with_name("16-40-01-2"), dated.with_name("16-40-01-3"))
    assert all(p.is_dir() for p in (first, second, third))


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("refusal", ["another text", "a damaged checkpoint"])
def test_a_refused_continuation_leaves_the_finished_run_as_it_was(tmp_path, refusal):
    """A finished run continued to more steps (``hydra.run.dir=<its folder>``), refused after its checkpoint was found
    -- the text has another vocabulary, or the newest checkpoint (one without checksums) is damaged -- exits 2 with
    one ``error:`` line and leaves every file of the folder byte for byte: summary.json, metrics.jsonl, .hydra/,
    runner.log (the refusal used to come after the tracker had dropped summary.json and Hydra rewrote .hydra/)."""
    from conftest import run_here

    text = make_tiny_text(tmp_path / "tiny.txt")
    job = tmp_path / "job"
    common = [*TINY_LOOP, *TINY_GPT, "checkpoint.every_steps=2", f"hydra.run.dir={job}"]
    first = run_here(*common, f"data.path={text}", cwd=tmp_path)
    assert first.returncode == 0 and (job / "summary.json").is_file(), first.stderr
    if refusal == "another text":
        other = tmp_path / "other.txt"
        other.write_text(text.read_text().replace("a", "Q"))
        data = f"data.path={other}"
    else:
        data = f"data.path={text}"
        newest = max((job / "checkpoints").glob("step_*"))
        (newest / "sha256.json").unlink()  # written by a runner without checksums, or killed before they were
        shard = next(newest.glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    before = _snapshot(job)
    refused = run_here(*common, data, "trainer.max_steps=8", cwd=tmp_path)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert [ln for ln in refused.stderr.splitlines() if ln.startswith("error:")], refused.stderr
    after = _snapshot(job)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert changed == [], changed


# ----------------------------------------------------------------------------- outputs that cannot be written
def _one_error_line(proc) -> str:
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stdout[-2000:] + proc.stderr[-4000:]
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    return line


def test_a_disk_full_while_logging_is_one_line_and_the_same_command_resumes(tmp_path, monkeypatch):
    """The disk fills mid-run (the metrics row of step 3 cannot be written): one ``error:`` line naming the folder,
    the last complete checkpoint (step 2, kept) and the command; once space is back the same command resumes from
    it and finishes the run."""
    import errno

    from conftest import TINY, run_here
    from runner.track import Tracker

    job = tmp_path / "job"
    command = [*TINY, "trainer.max_steps=6", "trainer.log_every=1", "checkpoint.every_steps=2", f"hydra.run.dir={job}"]
    log = Tracker.log

    def full_at_step_3(self, row):
        if row["step"] == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        log(self, row)

    monkeypatch.setattr(Tracker, "log", full_at_step_3)
    line = _one_error_line(run_here(*command, cwd=tmp_path))
    assert line.startswith("error: disk full: could not write ") and str(job) in line
    assert f"the last complete checkpoint, {job / 'checkpoints' / 'step_00000002'}, is kept" in line
    assert f"hydra.run.dir={job}" in line and not (job / "summary.json").exists()
    monkeypatch.setattr(Tracker, "log", log)  # space is back
    again = run_here(*command, cwd=tmp_path)
    assert again.returncode == 0 and "resumed from" in again.stdout and "step 2" in again.stdout, again.stderr
    assert read_summary(job)["steps"] == 6


def test_a_read_only_checkpoint_folder_is_one_line_keeping_the_last_checkpoint(tmp_path, monkeypatch):
    """A checkpoint folder that cannot be written (read-only: what DCP's writer raises there) stops the run with one
    line that says so and names the kept checkpoint; nothing partial is left."""
    import errno

    from torch.distributed.checkpoint import filesystem

    from conftest import TINY, run_here

    job = tmp_path / "job"
    command = [*TINY, "trainer.max_steps=4", "checkpoint.every_steps=2", f"hydra.run.dir={job}"]
    write_data = filesystem._FileSystemWriter.write_data
    saves = []

    def read_only_after_the_first(self, plan, planner):
        saves.append(1)
        if len(saves) > 1:
            raise OSError(errno.EROFS, "Read-only file system")
        return write_data(self, plan, planner)

    monkeypatch.setattr(filesystem._FileSystemWriter, "write_data", read_only_after_the_first)
    line = _one_error_line(run_here(*command, cwd=tmp_path))
    assert line.startswith(f"error: read-only file system: could not write checkpoint {job / 'checkpoints'}")
    assert f"the last complete checkpoint, {job / 'checkpoints' / 'step_00000002'}, is kept" in line
    assert [p.name for p in (job / "checkpoints").iterdir()] == ["step_00000002"]


def test_a_full_disk_at_hydra_s_own_files_or_the_final_weights_is_one_line(tmp_path, monkeypatch):
    """Hydra's ``.hydra/`` files (written before runner's code runs) and the final weights (safetensors reports a
    full disk as its own ``SafetensorError ... (os error 28)``) on a full disk: one line each, status 2."""
    import errno

    import hydra.core.utils
    import safetensors.torch

    from conftest import TINY, run_here

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(hydra.core.utils, "_save_config", full)
        line = _one_error_line(run_here(*TINY, f"hydra.run.dir={tmp_path / 'a'}", cwd=tmp_path))
    assert line.startswith(f"error: disk full: could not write {tmp_path / 'a'}") and "no checkpoint" in line

    def rust_full(*args, **kwargs):
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", rust_full)
    line = _one_error_line(run_here(*TINY, f"hydra.run.dir={tmp_path / 'b'}", cwd=tmp_path))
    assert line.startswith(f"error: disk full while writing {tmp_path / 'b' / 'model.safetensors'}")
    assert not (tmp_path / "b" / "model.safetensors").exists() and not (tmp_path / "b" / "model.partial").exists()


def test_links_planted_where_hydra_writes_a_job_s_files_leave_their_targets_unchanged(tmp_path):
    """A copied run folder continued (``hydra.run.dir=<it>``): links at ``.hydra/config.yaml``, ``overrides.yaml`` and
    the job log ``runner.log`` -- files Hydra itself opens through any link -- are removed when the folder is locked,
    before Hydra writes, so the stand-in ``~/.bashrc`` they point at is unchanged."""
    from conftest import run_here

    victim = tmp_path / "bashrc"
    victim.write_text("precious\n")
    job = tmp_path / "job"
    common = [*TINY_LOOP, "checkpoint.every_steps=2", "trainer.doctor=false", f"hydra.run.dir={job}"]
    assert run_here(*common, cwd=tmp_path).returncode == 0
    for name in (".hydra/config.yaml", ".hydra/overrides.yaml", "runner.log"):
        (job / name).unlink()
        (job / name).symlink_to(victim)
    again = run_here(*common, "trainer.max_steps=8", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert victim.read_text() == "precious\n"
    for name in (".hydra/config.yaml", ".hydra/overrides.yaml", "runner.log"):
        assert (job / name).is_file() and not (job / name).is_symlink(), name
    assert "max_steps: 8" in (job / ".hydra" / "config.yaml").read_text()


def test_a_sweep_report_on_a_full_disk_is_one_error_line_naming_the_command_that_writes_it(tmp_path, monkeypatch):
    """Two jobs finish, then the sweep's report cannot be written (a full disk): one ``error:`` line naming the sweep
    folder and ``python -m runner.report`` (which writes it once there is room), status 2; the jobs' folders stay."""
    import errno

    from conftest import TINY, run_here
    from runner.report import end

    def full(sweep):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(end, "write_plain_report", full)
    sweep = tmp_path / "sweep"
    proc = run_here(
        "-m",
        *TINY,
        "trainer.max_steps=2",
        "trainer.doctor=false",
        "optimizer.lr=0.01,0.02",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    line = _one_error_line(proc)
    assert line.startswith(f"error: disk full: could not write the sweep report in {sweep}")
    assert line.endswith(f"python -m runner.report {sweep}")
    assert read_summary(sweep / "0")["steps"] == read_summary(sweep / "1")["steps"] == 2
