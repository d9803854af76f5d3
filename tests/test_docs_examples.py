"""The README's and docs' examples run as copied: every ``python -m runner ...`` line of their bash blocks, and the
config and Python files they show (a block whose first lines name the file, ``# my_conf/experiment/mine.yaml``).

A representative few run for real, through the CLI, in a scratch folder holding the files the docs show, with
small overrides merged in (``SMALL``: 2 steps, 1 evaluation batch, no W&B; a key the command sets is replaced,
as the doctor's suggestions do) and placeholders mapped to tiny real data (``/path/with/cifar``: a CIFAR-10
made by ``make_tiny_cifar``; ``/my/images``: an ImageFolder; ``my.txt``: a text; ``outputs/<date>/<time>``: the
folder of a run made first). Every other line is composed exactly as ``python -m runner`` would (Hydra, the
schemas, ``runner.engine.validate``) in this process, since composing is what fails on a wrong key, option or file;
lines that need SLURM, several processes, network or the reader's own package are skipped with the reason.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import job_dirs, make_tiny_cifar, make_tiny_imagefolder, make_tiny_text, run_cli
from runner import REPO_ROOT
from runner.doctor.job import merge_overrides

DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]

#: Appended to a command that runs for real: a tiny, quiet CPU job (the command's own value of a key is replaced).
SMALL = [
    "trainer.max_steps=2",
    "trainer.warmup_steps=1",
    "trainer.eval_max_batches=1",
    "trainer.log_every=1",
    "logger=none",
    "trainer.progress=off",
    "trainer.device=cpu",
    "scheduler.warmup_steps=1",
]  # a preset's LR warm-up (cosine) must fit in the 2 steps

#: Lines that cannot run here, by their start: why.
SKIPPED = {
    "pip ": "installs packages",
    "pytest": "the test suite itself",
    "sbatch ": "needs SLURM",
    "srun ": "needs SLURM",
    "torchrun ": "several processes (tests/test_distributed.py runs torchrun)",
    "scripts/": "a launch script (torchrun)",
    "python -m runner.torchrun ": "several processes (tests/test_resume.py)",
    "curl ": "downloads",
    "python -c ": "a snippet, not a runner command",
    "tensorboard ": "TensorBoard's viewer (tests/test_loggers.py reads the event files)",
    "mlflow ": "MLflow's viewer (tests/test_loggers.py reads the store)",
    "MLFLOW_TRACKING_URI=": "needs an MLflow tracking server (tests/test_loggers.py starts one)",
    "python -m runner.data.tokens ": "writes token files (tests/test_tokens.py runs prepare and its CLI)",
    "python -m runner.evaluate ": "a finished job's evaluation (tests/test_evaluate_export.py runs it)",
    "python -m runner.export ": "a finished job's export (tests/test_evaluate_export.py runs it)",
}

#: Arguments that make a line skip even as a composition: why.
NEEDS = {
    "hydra/launcher=submitit_slurm": "needs SLURM (tests/test_slurm.py)",
    "pkg://mypackage.conf": "needs the reader's own package",
    "my_models.Net": "needs the reader's own my_models.py (not shown in the docs)",
    "outputs/ablation/<date>/<time>": "needs an ablation sweep (tests/test_ablation.py rebuilds one's report)",
    "outputs/convergence/<date>/<time>": "needs a convergence sweep (tests/test_convergence.py rebuilds one's report)",
    "outputs/tune/speed/<date>_<time>": "needs the speed tuner's preset (tests/test_tune_speed.py runs one)",
}


@dataclass
class Example:
    doc: str  # file name
    line: int
    text: str  # the line as written, comment removed

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.text)

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.text}"


def _blocks(path: Path):
    """(language, first line number, body) of each fenced block of ``path``."""
    text = path.read_text()
    for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        yield m.group(1), text[: m.start()].count("\n") + 2, m.group(2)


def examples() -> list[Example]:
    """Every non-empty line of every bash block in the README and docs/*.md, its trailing comment removed."""
    found = []
    for path in DOCS:
        for lang, first, body in _blocks(path):
            if lang != "bash":
                continue
            for i, raw in enumerate(body.splitlines()):
                text = re.sub(r"\s+#\s.*$", "", raw).strip()
                if text:
                    found.append(Example(path.name, first + i, text))
    return found


def shown_files() -> dict[str, str]:
    """The files the docs show for the reader to save (a yaml or python block whose first or second line is a
    comment naming a relative ``.yaml``/``.py`` path), outside runner's own ``conf/``: path -> content."""
    files = {}
    for path in DOCS:
        for lang, _, body in _blocks(path):
            head = body.splitlines()[:2]
            named = [m.group(1) for line in head if (m := re.match(r"#\s*([\w./-]+\.(?:yaml|py))\b", line))]
            if lang in ("yaml", "python") and named and not named[0].startswith(("conf/", "/")):
                files[named[0]] = body
    return files


def skip_reason(example: Example) -> str | None:
    for start, why in SKIPPED.items():
        if example.text.startswith(start):
            return why
    return next((why for needle, why in NEEDS.items() if needle in example.text), None)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """A folder as a reader would have it: the files the docs show, and tiny data where the docs name theirs."""
    root = tmp_path_factory.mktemp("docs")
    for name, content in shown_files().items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(content)
    make_tiny_cifar(root / "cifar")
    make_tiny_imagefolder(root / "images")
    make_tiny_text(root / "my.txt", repeats=16)  # ~4 KB: a small text trains with the preset
    return root


def placeholders(args: list[str], root: Path, job: Path | None = None, sweep: Path | None = None) -> list[str]:
    """The docs' placeholder paths as the scratch folder's real ones."""
    swap = {
        "/path/with/cifar": root / "cifar",
        "/path/to/cifar": root / "cifar",
        "/my/images": root / "images",
        "/path/to/tinyshakespeare/input.txt": root / "my.txt",
        "my.txt": root / "my.txt",
        "/abs/path/my_conf": root / "my_conf",
        "outputs/multirun/<date>/<time>": sweep,
        "outputs/<date>/<time>": job,
    }
    out = []
    for a in args:
        for placeholder, real in swap.items():
            if placeholder in a and (a.endswith(placeholder) or a.endswith(placeholder + "]")):
                a = a.replace(placeholder, str(real))
        out.append(a)
    return out


def find(doc: str, start: str) -> Example:
    """The example of ``doc`` that starts with ``start`` (the docs changed when there is none: update here)."""
    hits = [e for e in examples() if e.doc == doc and e.text.startswith(start)]
    assert hits, f"{doc} has no example starting with {start!r} any more: update tests/test_docs_examples.py"
    return hits[0]


def run(example: Example, root: Path, *extra: str, module: str = "runner", **where) -> tuple[str, Path | None]:
    """Run ``example`` through the CLI in ``root`` with ``SMALL`` and ``extra`` merged in; its output and the
    newest job folder. Fails with the example's doc and line when it exits non-zero."""
    args = placeholders(example.argv[3:], root, **where)
    if module == "runner":
        args = merge_overrides(args, [*SMALL, *extra])
    proc = run_cli(*args, cwd=root, module=module, timeout=300)
    assert proc.returncode == 0, (
        f"{example} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
    )
    jobs = job_dirs(root) if (root / "outputs").is_dir() else []
    return proc.stdout + proc.stderr, (jobs[-1] if jobs else None)


# ------------------------------------------------------------------------------ run for real


@pytest.mark.cli
def test_the_readme_first_run_and_the_doctor_on_its_folder(scratch):
    out, job = run(find("README.md", "python -m runner"), scratch)
    assert (job / "summary.json").is_file() and "summary (" not in out  # trainer.progress=off
    doctor = find("README.md", "python -m runner.doctor outputs/<date>/<time>")
    args = [a for a in placeholders(doctor.argv[3:], scratch, job=job) if a != "--verify"]  # --verify reruns
    proc = run_cli(*args, cwd=scratch, module="runner.doctor")  # jobs: tests/test_doctor.py covers it
    assert proc.returncode == 0 and proc.stdout.startswith("speed doctor"), f"{doctor}:\n{proc.stdout}{proc.stderr}"


@pytest.mark.slow
def test_the_readme_sweep_and_its_report(scratch):
    sweep_line = find("README.md", "python -m runner -m dataloader.batch_size=")
    run(sweep_line, scratch)
    sweeps = sorted((scratch / "outputs" / "multirun").glob("*/*"))
    assert len(list(sweeps[-1].glob("*/summary.json"))) == 6, f"{sweep_line}: not 6 jobs"
    report = find("README.md", "python -m runner.report outputs/multirun/")
    out, _ = run(report, scratch, module="runner.report", sweep=sweeps[-1])
    assert (sweeps[-1] / "report.md").is_file(), f"{report}: {out}"


@pytest.mark.cli
def test_the_readme_custom_data_command(scratch):
    out, job = run(
        find("README.md", "python -m runner data=custom data._target_=my_data.tabular data.n_features"), scratch
    )
    assert (job / "summary.json").is_file()


@pytest.mark.slow  # CI budget (durations on 2 cores): `pytest -m slow` runs it
def test_the_readme_cifar_command_on_a_tiny_cifar(scratch):
    out, job = run(find("README.md", "python -m runner data=cifar10"), scratch)
    assert '"eval_accuracy"' in (job / "summary.json").read_text()


@pytest.mark.cli
def test_own_configs_as_the_docs_show_them(scratch):
    """docs/configuration.md's two files and its command (the package line must come first in mine.yaml)."""
    assert (scratch / "my_conf" / "experiment" / "mine.yaml").read_text().startswith("# @package _global_")
    out, job = run(find("configuration.md", "python -m runner --config-dir my_conf +experiment=mine"), scratch)
    config = (job / ".hydra" / "config.yaml").read_text()
    assert "lr: 0.002" in config and "weight_decay: 0.05" in config and "name: cosine" in config


@pytest.mark.cli
def test_own_text_with_the_language_model_preset(scratch):
    out, job = run(
        find("language-models.md", "python -m runner +experiment=shakespeare_char data.path=my.txt"),
        scratch,
        "task.sample_tokens=20",
    )  # samples.txt: 20 characters, not 500
    assert (job / "samples.txt").is_file()


@pytest.mark.cli
@pytest.mark.parametrize("flag", ["--help", "--cfg job", "--info searchpath"])
def test_the_cli_flags_the_docs_show(scratch, flag):
    example = find("configuration.md", f"python -m runner {flag}")
    proc = run_cli(*example.argv[3:], cwd=scratch)
    assert proc.returncode == 0 and proc.stdout.strip(), f"{example}: {proc.stderr[-2000:]}"


# ------------------------------------------------------------------------------ every other line: composed

RUN_ABOVE = (
    "python -m runner.doctor ",
    "python -m runner.report outputs/multirun/",
    "python -m runner --help",
    "python -m runner --cfg job",
    "python -m runner --info",
)


def compose_example(example: Example, root: Path):
    """Compose the command's config as ``python -m runner`` (or ``runner.tune``) would, and check it with
    ``runner.engine.validate``: a wrong option, key, file or cross-key value fails here. ``...`` (elided arguments) are
    left out; of a sweep (``-m``), each key's first value is composed (of an interval, its lower end)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from runner.engine.validate import validate

    args = [a for a in placeholders(example.argv[2:], root) if a != "..."]
    module = args.pop(0)
    if module == "runner.tune":
        from runner.tune import TUNERS

        assert args and args[0] in TUNERS, f"{example}: no tuner {args[:1]} (tuners: {', '.join(TUNERS)})"
        args = args[1:]
    else:
        assert module == "runner", f"{example}: unknown module {module}"
    overrides, i = [], 0
    while i < len(args):
        if args[i] in ("--config-dir", "-cd"):
            overrides.append(f"hydra.searchpath=[file://{(root / args[i + 1]).resolve()}]")
            i += 2
            continue
        if args[i] == "-m":
            i += 1
            continue
        assert not args[i].startswith("-"), f"{example}: flag {args[i]} not composed here: run it in a test above"
        overrides.append(args[i])
        i += 1
    parser = OverridesParser.create()
    plain = []
    for text in overrides:
        override = parser.parse_override(text)
        if override.is_interval_sweep():  # a recipe search's range (hydra/sweeper=search): its lower end
            text = f"{override.get_key_element()}={override.value().start}"
        elif override.is_sweep_override():
            value = next(iter(override.sweep_string_iterator()))
            text = f"{override.get_key_element()}={value}"
        plain.append(text)
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=plain)
    validate(cfg)
    return cfg


#: The commands the tests above run (the README's first run, sweep, custom data and CIFAR lines; the own configs
#: and own text examples).
RUN = {
    "python -m runner",
    "python -m runner --config-dir my_conf +experiment=mine",
    "python -m runner +experiment=shakespeare_char data.path=my.txt",
}
RUN_STARTS = (
    "python -m runner -m dataloader.batch_size=",
    "python -m runner data=custom data._target_=my_data.tabular data.n_features",
    "python -m runner data=cifar10",
)


def _composed() -> list[Example]:
    seen, out = set(), []
    for e in examples():
        if (
            skip_reason(e)
            or e.text.startswith(RUN_ABOVE)
            or e.text in RUN
            or e.text.startswith(RUN_STARTS)
            or e.text in seen
        ):
            continue
        seen.add(e.text)  # the same line in two documents is composed once
        out.append(e)
    return out


COMPOSED = _composed()


@pytest.mark.parametrize("example", COMPOSED, ids=[f"{e.doc}:{e.line}" for e in COMPOSED])
def test_every_other_example_composes(example, scratch, monkeypatch):
    monkeypatch.chdir(scratch)  # relative paths (my_conf, my_data) as from the reader's folder
    compose_example(example, scratch)


def test_every_skipped_example_says_why():
    skipped = {str(e): skip_reason(e) for e in examples() if skip_reason(e)}
    assert all(skipped.values())
    assert len(COMPOSED) > 20 and len(skipped) < len(COMPOSED)  # most examples are checked
