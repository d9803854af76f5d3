"""The recipe search: ``optimized_metric`` (what ``python -m runner`` returns to a Hydra sweeper) and
``hydra/sweeper=search`` (runner/sweeps/search.py: Optuna ask-and-tell, verification on fresh seeds, the paste line).

The searches are real multiruns of ``python -m runner`` on a tiny synthetic job. On that job's random labels a
tiny LR keeps the evaluation loss near ln(10) while LR 0.05 makes it blow up within 4 steps: the constructed case
where one LR is clearly better, whichever way the metric points.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import yaml

from conftest import TINY, compose_cfg, read_summary, run_cli, run_tiny
from runner import REPO_ROOT, objective
from runner.errors import ConfigError
from runner.sweeps.search_end import paste_line

#: A search over two LRs that tries both (BruteForceSampler), each trial the tiny job
SEARCH = [
    "-m",
    "hydra/sweeper=search",
    "hydra.sweeper.n_trials=3",
    "trainer.doctor=false",
    "+hydra.sweeper.params={optimizer.lr: 'choice(0.000001, 0.05)'}",
    "hydra.sweeper.sampler._target_=optuna.samplers.BruteForceSampler",
    "~hydra.sweeper.sampler.seed",
    *TINY,
]


def trial_values(stdout: str, metric: str) -> list[float]:
    return [float(v) for v in re.findall(rf"^trial \d+: {metric} = (\S+)", stdout, re.M)]


def test_python_m_runner_returns_the_named_metric(monkeypatch):
    """The Hydra task function's return value is the summary figure ``optimized_metric`` names (samples/s when
    null): what Hydra hands a sweeper."""
    import runner.__main__ as cli
    import runner.engine.train

    summary = {
        "samples_per_sec": 123.0,
        "eval_loss": 0.25,
        "eval_accuracy": 0.9,
        "time_to_target_s": None,
        "train_time_s": 7.0,
        "steps": 10,
        "global_batch_size": 16,
    }
    monkeypatch.setattr(runner.engine.train, "train", lambda cfg, on_evaluation=None: summary)
    assert cli._train(compose_cfg("trainer.doctor=false")) == 123.0
    assert cli._train(compose_cfg("trainer.doctor=false", "optimized_metric=eval_loss")) == 0.25
    assert cli._train(compose_cfg("trainer.doctor=false", "optimized_metric=eval_accuracy")) == 0.9
    # the target was missed: twice the training time it spent, never a good-looking figure
    cfg = compose_cfg("trainer.doctor=false", "optimized_metric=time_to_target_s", "trainer.target_accuracy=0.98")
    assert cli._train(cfg) == objective.CENSORED_FACTOR * 7.0
    summary["time_to_target_s"] = 3.5
    assert cli._train(cfg) == 3.5


def test_a_real_run_returns_its_summary_figure(tmp_path):
    summary = run_tiny(tmp_path, "optimized_metric=eval_loss")
    assert objective.value(summary, "eval_loss") == summary["eval_loss"]
    assert math.isfinite(summary["eval_loss"])
    censored = objective.value(summary | {"time_to_target_s": None}, "samples_to_target")
    assert censored == objective.CENSORED_FACTOR * summary["steps"] * summary["global_batch_size"]


def test_a_bad_optimized_metric_is_one_clear_error(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"^optimized_metric=eval_acc is not a figure .*did you mean "
        r"optimized_metric=eval_accuracy\?.*time_to_target_s",
    ):
        objective.check(compose_cfg("optimized_metric=eval_acc"))
    with pytest.raises(ConfigError, match=r"optimized_metric=time_to_target_s needs a target"):
        objective.check(compose_cfg("optimized_metric=time_to_target_s"))
    r = run_cli("optimized_metric=eval_acc", *TINY, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "optimized_metric=eval_acc" in errors[0] and "eval_accuracy" in errors[0], r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "outputs").exists() or not list((tmp_path / "outputs").rglob("summary.json"))


@pytest.mark.cli
def test_the_search_refuses_a_bad_metric_before_any_trial(tmp_path):
    pytest.importorskip("optuna")
    r = run_cli(*SEARCH, "optimized_metric=speed", cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "optimized_metric=speed" in errors[0], r.stderr[-2000:]
    assert "trial 1" not in r.stdout
    r = run_cli(*SEARCH, cwd=tmp_path)  # no optimized_metric at all
    assert r.returncode == 2 and "needs optimized_metric=" in r.stderr, r.stderr[-2000:]


@pytest.mark.slow  # ~14 s on 2 busy cores: two tiny trials in one multirun
def test_the_search_finds_the_better_lr_and_prints_the_line_to_paste(tmp_path):
    """Each trial's value is the job's summary figure (the sweeper got the named metric); the best is the lower
    eval loss; with the space exhausted the search stops early; the paste line carries the best LR and the
    ``--config-dir`` the search's preset came from, and runs as printed."""
    import shlex

    pytest.importorskip("optuna")
    mine = tmp_path / "my-configs" / "experiment"
    mine.mkdir(parents=True)
    (mine / "tab.yaml").write_text("# @package _global_\ntrainer:\n  eval_every: 2\n")
    r = run_cli(
        "--config-dir",
        "my-configs",
        "+experiment=tab",
        *SEARCH,
        "optimized_metric=eval_loss",
        "hydra.sweeper.verify_seeds=0",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    values = trial_values(r.stdout, "eval_loss")
    assert len(values) == 2, r.stdout  # two points: the brute-force sampler ends the search after them
    sweep = next((tmp_path / "outputs" / "multirun").glob("*/*"))
    jobs = {read_summary(sweep / str(n))["config"]["optimizer"]["lr"]: read_summary(sweep / str(n)) for n in range(2)}
    assert sorted(values) == sorted(s["eval_loss"] for s in jobs.values())
    best_lr = min(jobs, key=lambda lr: jobs[lr]["eval_loss"])
    assert jobs[best_lr]["eval_loss"] < 0.5 * max(s["eval_loss"] for s in jobs.values())  # clearly better
    paste = r.stdout.splitlines()[r.stdout.splitlines().index("the recipe found (paste it):") + 1]
    assert paste.startswith("python -m runner ") and f"optimizer.lr={best_lr!r}" in paste.split(), paste
    assert "hydra/sweeper=search" not in paste and "optimized_metric" not in paste
    assert "verification skipped (hydra.sweeper.verify_seeds=0)" in r.stdout
    results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert results["best_params"] == {"optimizer.lr": best_lr} and results["command"] == paste
    assert "sweep report" not in r.stdout  # the search's own tables end it, not the plain sweep's
    assert f"--config-dir {tmp_path / 'my-configs'} +experiment=tab" in paste
    (tmp_path / "elsewhere").mkdir()  # run as pasted, from another folder
    pasted = run_cli(*shlex.split(paste)[3:], "hydra.run.dir=pasted", cwd=tmp_path / "elsewhere")
    assert pasted.returncode == 0, pasted.stderr[-2000:]
    config = read_summary(tmp_path / "elsewhere" / "pasted")["config"]
    assert config["optimizer"]["lr"] == best_lr and config["trainer"]["eval_every"] == 2


@pytest.mark.cli  # trials in processes of their own
def test_n_jobs_trials_run_in_slots_and_a_freed_slot_starts_the_next_at_once(tmp_path):
    """``hydra.sweeper.n_jobs=2`` on the basic launcher: trials run two at a time in processes of their own, in
    ``<sweep>/<job>``; a slot that frees starts the next trial while the long one still runs (no batch barrier); each
    trial is told its own job's figure, and the search says how busy its slots were. Once no trial is left to ask, a
    free slot starts the verification's runs of the starting recipe ahead (they do not depend on the best trial)."""
    pytest.importorskip("optuna")
    job = [o for o in TINY if not o.startswith("trainer.max_steps=")]  # the searched key
    r = run_cli(
        "-m",
        "hydra/sweeper=search",
        "hydra.sweeper.n_trials=3",
        "trainer.doctor=false",
        *job,
        "+hydra.sweeper.params={trainer.max_steps: 'choice(400, 3, 4)'}",
        "optimized_metric=eval_loss",
        "hydra.sweeper.sampler._target_=optuna.samplers.BruteForceSampler",
        "hydra.sweeper.sampler.seed=5",
        "hydra.sweeper.verify_seeds=1",
        "trainer.target_loss=0.5",  # the verification compares times to a target (these tiny runs never reach it)
        "hydra.sweeper.n_jobs=2",
        "trainer.log_every=1",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        cwd=tmp_path,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert re.search(r"^slots: 2 trials at a time, busy \d+% of the slot-time$", r.stdout, re.M), r.stdout
    jobs = {n: read_summary(tmp_path / "sweep" / str(n)) for n in range(3)}
    told = sorted(trial_values(r.stdout, "eval_loss"))
    assert told == sorted(s["eval_loss"] for s in jobs.values())
    import optuna

    trials = optuna.load_study(study_name="runner-search", storage=f"sqlite:///{tmp_path / 'sweep' / 'study.db'}")
    started = {t.user_attrs["job"]: t.user_attrs["started"] for t in trials.trials}  # when the search started it
    ended = {n: (tmp_path / "sweep" / str(n) / "summary.json").stat().st_mtime for n in jobs}
    assert jobs[0]["steps"] == 400 and jobs[1]["steps"] < 10, jobs  # the seed asks the long trial first
    assert ended[1] <= started[2] < ended[0], (started, ended)  # the third started in the slot the short one freed
    # the verification: best and start on seed 100, the start's run in a slot no trial would take
    assert "verification run ahead: the starting recipe on seed 100" in r.stdout, r.stdout[-3000:]
    seeds = {
        f"{p.parent.parent.name}/{p.parent.name}": read_summary(p.parent)["config"]["trainer"]["seed"]
        for p in (tmp_path / "sweep" / "verify").rglob("summary.json")
    }
    assert seeds == {f"{side}/seed{s}": s for side in ("best", "start") for s in (100,)}, seeds
    assert re.search(r"^\| starting recipe \| 0/1 \|", r.stdout, re.M), r.stdout[-3000:]  # run ahead, and counted


def test_slot_jobs_share_the_cpus_out_and_the_busy_share_counts_running_jobs(tmp_path, monkeypatch):
    """Where ``trainer.num_threads`` is null each of ``n`` slot jobs gets the CPUs shared out, first on its command
    line (the job's own override wins); the busy share counts a job still running when it is read."""
    import os
    import subprocess
    import time

    from omegaconf import OmegaConf

    from runner.sweeps import slots

    cpus = len(os.sched_getaffinity(0))
    assert slots.threads_each(OmegaConf.create({"trainer": {"num_threads": None}}), 2) == max(1, cpus // 2)
    assert slots.threads_each(OmegaConf.create({"trainer": {"num_threads": 3}}), 2) is None
    started = []
    monkeypatch.setattr(
        subprocess, "Popen", lambda command, **kw: started.append(command) or subprocess.CompletedProcess(command, 0)
    )
    pool = slots.Slots(2, threads=1)
    pool.start("job", tmp_path / "j", ["trainer.num_threads=2", "trainer.max_steps=3"])
    assert started[0][3:6] == ["trainer.num_threads=1", "trainer.num_threads=2", "trainer.max_steps=3"], started
    time.sleep(0.2)
    assert pool.utilization() == pytest.approx(0.5, abs=0.05)  # one of two slots busy since the start


def test_n_jobs_with_the_interleaved_launcher_is_refused(tmp_path):
    from conftest import run_here

    r = run_here(
        *SEARCH, "optimized_metric=eval_loss", "hydra.sweeper.n_jobs=2", "hydra/launcher=interleaved", cwd=tmp_path
    )
    assert r.returncode == 2 and "the interleaved launcher compares jobs" in r.stderr, r.stderr[-2000:]


@pytest.mark.slow  # ~12 s alone: 2 trials, 2 x 5 verification runs, in one process (the slots: the test above)
def test_the_best_trial_is_verified_on_fresh_seeds(tmp_path):
    """To target: the trial that missed it is never the best; the verification runs best and start on seeds
    100..104 (not the search's 0) and compares their samples and times to target with intervals and verdicts: the
    rank test, since the start's runs never reached the target."""
    pytest.importorskip("optuna")
    # the LR is the batch's share of optimizer.lr (lr_scaling=linear): 0.2 x 16/64 = 0.05, the starting recipe's,
    # blows up; the base batch searched, 64000, gives 0.00005, which keeps the loss near ln(10) at the target
    space = "+hydra.sweeper.params={optimizer.base_batch_size: 'choice(64, 64000)'}"
    r = run_cli(
        *[a for a in SEARCH if not a.startswith("+hydra.sweeper.params")],
        space,
        "optimizer.lr=0.2",
        "optimizer.lr_scaling=linear",
        "optimized_metric=samples_to_target",
        "trainer.target_loss=2.4",
        "trainer.eval_every=2",
        "trainer.stop_at_target=true",
        "hydra.sweeper.verify_seeds=5",
        "hydra.sweeper.recipe=['+experiment=baseline']",
        "hydra.sweeper.pruner=median",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "target not reached" in r.stdout and "reached the target" in r.stdout, r.stdout
    assert "cannot report" not in r.stdout + r.stderr  # the verification's runs are no trials of the study
    sweep = next((tmp_path / "outputs" / "multirun").glob("*/*"))
    seeds = {
        f"{p.parent.parent.name}/{p.parent.name}": read_summary(p.parent)["config"]["trainer"]["seed"]
        for side in ("best", "start")
        for p in (sweep / "verify" / side).rglob("summary.json")
    }
    assert seeds == {f"{side}/seed{s}": s for side in ("best", "start") for s in range(100, 105)}
    line = next(x for x in r.stdout.splitlines() if x.startswith("samples to target, best / start:"))
    assert "it needs fewer samples" in line, r.stdout[-3000:]
    assert re.search(r"\| best trial \(trial \d\) \| 5/5 \|", r.stdout), r.stdout[-3000:]
    assert re.search(r"\| starting recipe \| 0/5 \|", r.stdout), r.stdout[-3000:]
    assert re.search(r"^wall time: [\d.]+ min, the trials [\d.]+ and the verification [\d.]+ \(\d+%\)", r.stdout, re.M)
    assert "verification run ahead" not in r.stdout  # no slots: Hydra's launcher, one launch a seed
    # the start never reached the target: time ratio 0 (its runs censored), by the rank test
    timed = next(x for x in r.stdout.splitlines() if x.startswith("time to target, best / start"))
    assert re.match(r"time to target, best / start \(rank test\): x0 \[0, [\d.e-]+\] at 98.33%", timed), timed
    results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())["verification"]
    # (the time interval's upper end depends on how long the start's runs trained: a busy machine may leave it above 1)
    assert results["time_to_target"]["estimate"] == 0 and results["samples_to_target"]["high"] < 1, results
    assert r.stdout.splitlines()[-1].endswith(" optimizer.base_batch_size=64000"), r.stdout[-2000:]
    assert r.stdout.splitlines()[-1].startswith("python -m runner +experiment=baseline "), r.stdout[-2000:]  # recipe


def search_sweeper(name: str):
    """``hydra.sweeper`` of ``hparams_search=<name>``, composed with Hydra's own config."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"hparams_search={name}"], return_hydra_config=True)
    return cfg.hydra.sweeper


def test_the_search_file_composes():
    """conf/hparams_search/mnist_optuna.yaml: the metric, its target, the sweeper and the space over LR,
    schedule, batch size and optimizer."""
    cfg = compose_cfg("hparams_search=mnist_optuna", tiny=False)
    assert cfg.optimized_metric == "time_to_target_s" and cfg.trainer.target_accuracy == 0.98
    objective.check(cfg)
    sweeper = search_sweeper("mnist_optuna")
    assert sweeper._target_ == objective.SEARCH_SWEEPER
    assert set(sweeper.params) == {"optimizer", "optimizer.lr", "scheduler", "dataloader.batch_size", "ema"}
    assert cfg.trainer.eval_every == 2560 // cfg.dataloader.batch_size  # dated every 2,560 samples at any batch
    assert Path(REPO_ROOT / "conf" / "hydra" / "sweeper" / "search.yaml").is_file()


@pytest.mark.optuna
@pytest.mark.parametrize("name", ["mnist_optuna", "gpt_optuna"])
def test_a_search_file_sets_its_sampler_so_every_optuna_samples_alike(name):
    """Optuna 5 made multivariate TPE and the constant liar TPESampler's defaults: a search file that left them
    unset sampled other trials under Optuna 4. Each file sets them (and its seed), and the sampler built from it
    has them on under the installed Optuna."""
    from hydra.utils import instantiate

    sampler = search_sweeper(name).sampler
    assert sampler.multivariate is True and sampler.constant_liar is True and sampler.seed == 1234
    built = instantiate(sampler)
    assert built._multivariate is True and built._constant_liar is True


def asked_trials(name: str, n: int = 12, n_jobs: int = 2) -> list[dict]:
    """The points the sampler of ``hparams_search=<name>`` asks over its space, ``n_jobs`` running at a time (the
    constant liar sees them), each told a value that depends on its point alone: the search's trials, less the
    training."""
    import optuna
    from hydra.utils import instantiate

    from runner.sweeps.search import search_space

    sweeper = search_sweeper(name)
    space, _ = search_space(dict(sweeper.params), [])
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=instantiate(sweeper.sampler))
    asked, running = [], []
    for _ in range(n):
        running.append(study.ask(space))
        asked.append(running[-1].params)
        if len(running) == n_jobs:
            done = running.pop(0)
            study.tell(
                done, sum((math.log(v) if isinstance(v, float) else len(str(v))) ** 2 for v in done.params.values())
            )
    return asked


#: The trials conf/hparams_search/mnist_optuna.yaml asks (``asked_trials``), recorded under Optuna 5.1.0; the same
#: under 5.0.0, the oldest the project supports (.ci/run runs the search's tests under it too)
RECORDED = Path(__file__).parent / "data" / "mnist_optuna_trials.json"


@pytest.mark.optuna
def test_the_search_file_asks_the_recorded_trials_under_every_optuna():
    """One search file, one set of trials, whichever supported Optuna runs it: each 4.x release (4.0 to 4.6) asked
    other trials than 5.x from the sixth on, with the file's seed and options, so the search needs 5.0."""
    pytest.importorskip("optuna")
    asked, recorded = asked_trials("mnist_optuna"), json.loads(RECORDED.read_text())

    # the same points; a float's last bit follows numpy's build (2.4.6 rounded one LR ...008 where 2.3 gave ...007)
    def same(a, b) -> bool:
        return math.isclose(a, b, rel_tol=1e-12) if isinstance(a, float) and isinstance(b, float) else a == b

    assert len(asked) == len(recorded) and [t.keys() for t in asked] == [t.keys() for t in recorded], asked
    assert all(same(a[k], r[k]) for a, r in zip(asked, recorded) for k in a), asked


@pytest.mark.optuna
def test_an_optuna_older_than_the_recorded_trials_is_one_line(monkeypatch, capsys):
    optuna = pytest.importorskip("optuna")
    from runner.sweeps.search import make_sweeper

    monkeypatch.setattr(optuna, "__version__", "4.6.0")
    with pytest.raises(SystemExit) as e:
        make_sweeper()
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "Optuna >= 5.0, found 4.6.0" in err and "pip install" in err, err


def test_the_gpt_search_brings_the_recipe_and_its_own_target():
    """conf/hparams_search/gpt_optuna.yaml composes +experiment=shakespeare_char itself, so the recipe's target
    (1.88) cannot overwrite the search's 1.96, and the space leaves the recipe's optimizer alone."""
    recipe = compose_cfg("+experiment=shakespeare_char", tiny=False)
    cfg = compose_cfg("hparams_search=gpt_optuna", tiny=False)
    assert recipe.trainer.target_loss == 1.88 and cfg.trainer.target_loss == 1.96 and cfg.trainer.stop_at_target
    assert cfg.optimized_metric == "time_to_target_s"
    assert (cfg.model.n_layer, cfg.optimizer.lr, cfg.trainer.max_steps) == (4, 1e-3, 2000)
    assert cfg.optimizer._target_ == recipe.optimizer._target_ == "torch.optim.AdamW"
    objective.check(cfg)
    sweeper = search_sweeper("gpt_optuna")
    assert sweeper._target_ == objective.SEARCH_SWEEPER and sweeper.verify_seeds >= 4
    assert set(sweeper.params) == {"optimizer.lr", "scheduler", "dataloader.batch_size"}
    # the line to paste leaves the search file out, so it must bring the recipe back (it read "python -m runner
    # ... optimizer.lr=0.0035 scheduler=cosine dataloader.batch_size=8": the MNIST default with the GPT's settings)
    fixed = ["hparams_search=gpt_optuna", "trainer.num_threads=1"]
    line = paste_line(fixed, {"optimizer.lr": 0.0035, "scheduler": "cosine"}, list(sweeper.recipe))
    assert line == (
        "python -m runner +experiment=shakespeare_char trainer.num_threads=1 optimizer.lr=0.0035 scheduler=cosine"
    )
    assert compose_cfg(*line.split()[3:], tiny=False).model.n_layer == 4


@pytest.mark.optuna
def test_a_planted_trial_in_a_shared_study_is_never_the_best_nor_launched(tmp_path):
    """A finished trial planted in a shared SQLite study with a key the search does not own (a ``_target_`` that
    would run a pickle), a value outside its space, or inside it but with no record of a runner run (its folder and
    summary), is not the best trial: only the search's own rows are; the table lists the last as foreign."""
    import optuna
    from optuna.distributions import FloatDistribution

    from runner.sweeps.search import search_space
    from runner.sweeps.search_end import RUN, best_trial, in_space, trials_table

    space, _ = search_space({"optimizer.lr": "interval(0.01, 0.5)"}, [])
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'shared.db'}", study_name="s", direction="minimize")
    lr = {"optimizer.lr": FloatDistribution(0.01, 0.5)}
    (tmp_path / "job0").mkdir()
    (tmp_path / "job0" / "summary.json").write_text("{}")
    good = optuna.trial.create_trial(
        params={"optimizer.lr": 0.1},
        distributions=lr,
        value=0.5,
        user_attrs={RUN: {"folder": str(tmp_path / "job0"), "value": 0.5}},
    )
    inside = optuna.trial.create_trial(params={"optimizer.lr": 0.2}, distributions=lr, value=0.05)  # no record
    (tmp_path / "job1").mkdir()  # a record whose folder has no summary: not a run
    emptied = optuna.trial.create_trial(
        params={"optimizer.lr": 0.3},
        distributions=lr,
        value=0.04,
        user_attrs={RUN: {"folder": str(tmp_path / "job1"), "value": 0.04}},
    )
    outside = optuna.trial.create_trial(
        params={"optimizer.lr": 0.9}, distributions={"optimizer.lr": FloatDistribution(0.01, 1.0)}, value=0.1
    )
    planted = optuna.trial.create_trial(
        params={"optimizer.lr": 0.1, "model._target_": "numpy.load"},
        value=0.01,
        distributions={**lr, "model._target_": optuna.distributions.CategoricalDistribution(["numpy.load"])},
    )
    for t in (good, outside, planted, inside, emptied):
        study.add_trial(t)
    assert [in_space(t, space) for t in study.trials] == [True, False, False, True, True]
    assert best_trial(study, "train_loss", "minimize", space).params == {"optimizer.lr": 0.1}
    table = "\n".join(trials_table(study, "train_loss"))
    assert table.count("foreign: not run by a search of runner's") == 4, table


@pytest.mark.parametrize(
    "override, words",
    [
        ("hydra.sweeper.n_trials=0", "hydra.sweeper.n_trials=0 must be >= 1"),
        (
            "hydra.sweeper.storage=postgresql://nowhere:1/x",
            "hydra.sweeper.storage=postgresql://nowhere:1/x cannot be opened",
        ),
    ],
)
def test_a_search_that_cannot_run_is_one_error_line(override, words, tmp_path):
    from conftest import run_here

    proc = run_here("hparams_search=mnist_optuna", override, "logger=none", cwd=tmp_path)  # no -m: hydra.mode
    assert proc.returncode == 2 and words in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_a_search_where_no_trial_gives_the_metric_fails_with_the_fix(tmp_path):
    """Every trial without a figure (a metric the task does not report, here accuracy on a regression; or every
    trial diverged) ended rc 0 advising a wider space: it is exit status 1 and says what to check."""
    from conftest import run_here

    proc = run_here(
        "-m",
        "hparams_search=mnist_optuna",
        "trainer.num_threads=1",
        "logger=none",
        "trainer.progress=off",
        "trainer.max_steps=12",
        "trainer.eval_max_batches=2",
        "task=regression",
        "data=custom",
        "data._target_=user_data.regression",
        "model=mlp",
        "optimized_metric=eval_accuracy",
        "trainer.target_accuracy=null",
        "trainer.stop_at_target=false",
        "hydra.sweeper.n_trials=2",
        cwd=tmp_path,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "error: no trial gave eval_accuracy" in proc.stderr and "optimized_metric is a figure" in proc.stderr
    assert "widen the search space" not in proc.stdout


@pytest.mark.parametrize("storage", [None, pytest.param("sqlite", marks=pytest.mark.optuna), "slots"])
def test_a_pruner_stops_a_hopeless_trial_at_an_evaluation_and_records_it_censored(tmp_path, storage):
    """``hydra.sweeper.pruner``: each trial reports its evaluations to the study and stops where the pruner says.
    A threshold pruner (order-independent, unlike the median) at eval_loss 3: LR 0.05 overshoots to ~18 at its first
    evaluation and stops there, 4 of 12 steps, recorded pruned (censored), never failed; LR 1e-6 stays near 2.3,
    runs to its end and is the best. The end says what the pruning saved. With a storage each trial opens the study
    there, as one in a process of its own (submitit_slurm) does; with ``n_jobs=2`` each trial runs in a process of
    its own beside the other and finds its trial in the study the search keeps in its folder."""
    pytest.importorskip("optuna")
    from conftest import run_here

    stored = (
        [f"hydra.sweeper.storage=sqlite:///{tmp_path / 'search.db'}"]
        if storage == "sqlite"
        else ["hydra.sweeper.n_jobs=2"]
        if storage == "slots"
        else []
    )
    r = run_here(
        *SEARCH,
        *stored,
        "optimized_metric=eval_loss",
        "hydra.sweeper.verify_seeds=0",
        "trainer.max_steps=12",
        "trainer.eval_every=4",
        "+hydra.sweeper.pruner={_target_: optuna.pruners.ThresholdPruner, upper: 3.0}",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    sweep = next((tmp_path / "outputs" / "multirun").glob("*/*"))
    jobs = {read_summary(sweep / str(n))["config"]["optimizer"]["lr"]: read_summary(sweep / str(n)) for n in range(2)}
    pruned, kept = jobs[0.05], jobs[1e-06]
    assert pruned["steps"] == 4 and pruned["total_steps"] == 12 and pruned["eval_loss"] > 3
    assert pruned["stopped_early"].startswith("pruned by the search (ThresholdPruner) at 64 samples (step 4)")
    assert kept["steps"] == 12 and kept["stopped_early"] is None
    assert re.search(r"^trial \d: eval_loss = - \(pruned at 64 samples: censored there\)$", r.stdout, re.M), r.stdout
    assert re.search(
        r"^pruning \(ThresholdPruner\): 1 of 2 trials stopped early, saving about \d+\.\d min", r.stdout, re.M
    ), r.stdout
    results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert results["best_params"] == {"optimizer.lr": 1e-06}


def test_a_pruner_on_a_figure_no_evaluation_gives_is_refused(tmp_path):
    from conftest import run_here

    r = run_here(
        *SEARCH,
        "optimized_metric=samples_per_sec",
        "+hydra.sweeper.pruner={_target_: optuna.pruners.MedianPruner}",
        cwd=tmp_path,
    )
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: hydra.sweeper.pruner stops trials on their evaluations, but optimized_metric=samples_per_sec is no "
        "evaluation figure: prune a search for time_to_target_s, eval_loss or eval_accuracy, or set "
        "hydra.sweeper.pruner=null"
    ], r.stderr
    assert not (tmp_path / "outputs").exists() or not list((tmp_path / "outputs").rglob("summary.json"))
    misspelt = run_here(*SEARCH, "optimized_metric=eval_loss", "hydra.sweeper.pruner=medain", cwd=tmp_path)
    assert misspelt.returncode == 2 and misspelt.stderr.strip().splitlines() == [
        "error: hydra.sweeper.pruner=medain is not a pruner runner knows: use one of none, median, successive_halving, "
        "hyperband, or {_target_: optuna.pruners.<Class>, ...} for its arguments"
    ], misspelt.stderr


@pytest.mark.optuna
def test_the_pruners_by_name_are_optunas():
    optuna = pytest.importorskip("optuna")
    from runner.sweeps import pruning

    assert {name: type(pruning.build(name)) for name in pruning.NAMES} == {
        "none": optuna.pruners.NopPruner,
        "median": optuna.pruners.MedianPruner,
        "successive_halving": optuna.pruners.SuccessiveHalvingPruner,
        "hyperband": optuna.pruners.HyperbandPruner,
    }
    assert type(pruning.build(None)) is optuna.pruners.NopPruner
    assert pruning.build({"_target_": "optuna.pruners.MedianPruner", "n_startup_trials": 2})._n_startup_trials == 2
    assert pruning.intermediate("eval_accuracy", 0.9, "minimize") == pytest.approx(0.1)  # an error rate
    assert pruning.intermediate("eval_loss_ema", 0.5, "minimize") == 0.5
    assert pruning.intermediate("eval_accuracy", 0.9, "maximize") == 0.9


def test_the_evaluation_that_meets_the_target_is_reported_with_the_samples_the_run_skips(tmp_path):
    """The engine asks ``on_evaluation`` at the evaluation that meets the target too, with the global samples the
    run would have trained to (``ends``), so a pruner's study hears the trial's last figure; its answer is ignored."""
    from runner.engine.train import train

    calls = []
    cfg = compose_cfg(
        "trainer.max_steps=8", "trainer.eval_every=2", "trainer.target_loss=1e9", "trainer.stop_at_target=true"
    )
    summary = train(
        cfg,
        job_dir=tmp_path / "job",
        on_evaluation=lambda metrics, step, samples, ends: calls.append((step, samples, ends)) or "no",
    )
    batch = summary["global_batch_size"]
    assert calls == [(2, 2 * batch, 8 * batch)]
    assert summary["steps"] == 2 and summary["stopped_early"].startswith("reached the targets")


@pytest.mark.optuna
def test_a_trial_that_met_its_target_stands_for_the_grid_it_skipped_so_a_slower_one_is_pruned():
    """Optuna's median pruner compares a trial only with finished trials that reported at the same step. A trial that
    stopped at its target reports its last figure on the grid it skipped (``carried_forward``): a later trial still
    short of the target there is compared with it, and pruned, where without it no trial would be compared."""
    optuna = pytest.importorskip("optuna")
    from runner.sweeps import pruning

    assert list(pruning.carried_forward(2560, 40, 40, 10240)) == [5120, 7680, 10240]
    assert list(pruning.carried_forward(2560, 40, 0, 10240)) == []

    def search(carry: bool) -> bool:
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.create_study(pruner=optuna.pruners.MedianPruner(n_startup_trials=2))
        fast = study.ask()  # error rate 0.019 at 2,560 samples: met the target (0.02) and stopped
        fast.report(0.019, 2560)
        for later in pruning.carried_forward(2560, 40, 40, 10240) if carry else ():
            fast.report(0.019, later)
        study.tell(fast, 10.0)
        full = study.ask()  # ran its whole budget without reaching it
        for samples, error in ((2560, 0.05), (5120, 0.03), (7680, 0.025), (10240, 0.022)):
            full.report(error, samples)
        study.tell(full, 80.0)
        slow = study.ask()
        slow.report(0.03, 2560)  # between the two: kept
        assert not slow.should_prune()
        slow.report(0.028, 5120)  # behind the one that met the target, ahead of the one that did not
        return slow.should_prune()

    assert search(carry=True) and not search(carry=False)


def test_the_time_pruning_saved_counts_the_evaluations_the_pruned_trials_skipped():
    """A pruned trial would have gone on to its limit at its own pace, evaluating every ``eval_every`` steps: the
    saving is its remaining steps at (training + evaluation seconds) per step; trials that were not pruned save
    nothing."""
    from runner.sweeps import pruning

    pruned = {
        "stopped_early": f"{pruning.PRUNED} (MedianPruner) at 2,560 samples",
        "steps": 80,
        "total_steps": 1875,
        "train_time_s": 2.0,
        "eval_time_s": 6.0,
    }
    reached = {
        "stopped_early": "reached the targets: ...",
        "steps": 400,
        "total_steps": 1875,
        "train_time_s": 11.0,
        "eval_time_s": 40.0,
    }
    assert pruning.saved([pruned, reached]) == (1, pytest.approx(1795 * 8.0 / 80))


@pytest.mark.optuna
def test_a_search_on_another_host_is_dead_once_its_heartbeat_is_five_minutes_old(tmp_path):
    """Searches on several machines share a study: a trial whose search process ran on another host is failed once
    its heartbeat is older than ``STALE_S`` (a fresh one, or none from an older runner, is left RUNNING); a live
    search stamps its own running trials."""
    import time

    optuna = pytest.importorskip("optuna")
    from optuna.trial import TrialState

    from runner.sweeps import search

    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'shared.db'}", study_name="s")
    elsewhere = {"host": "another-machine", "pid": 1}
    beats = {"stale": time.time() - search.STALE_S - 1, "fresh": time.time() - 10, "none": None}
    trials = {}
    for name, beat in beats.items():
        trials[name] = study.ask()
        trials[name].set_user_attr("sweep", "x")
        trials[name].set_user_attr(search.OWNER, elsewhere)
        if beat is not None:
            trials[name].set_user_attr(search.HEARTBEAT, beat)
    assert search.counted(study) == 2  # the stale one no longer counts
    assert search.fail_dead_trials(study) == [trials["stale"].number]
    states = {t.number: t.state for t in study.trials}
    assert states[trials["stale"].number] == TrialState.FAIL
    assert {states[trials[n].number] for n in ("fresh", "none")} == {TrialState.RUNNING}
    mine = study.ask()
    mine.set_user_attr(search.OWNER, search._mine())
    with search.heartbeat(study, every_s=0.05):
        time.sleep(0.5)
    stamped = study.trials[mine.number].user_attrs.get(search.HEARTBEAT)
    assert stamped is not None and time.time() - stamped < 5
    assert (
        search.HEARTBEAT not in study.trials[trials["fresh"].number].user_attrs
        or study.trials[trials["fresh"].number].user_attrs[search.HEARTBEAT] == beats["fresh"]
    )  # another's: untouched


@pytest.mark.optuna
def test_a_search_killed_with_minus_9_is_continued_by_the_same_command(tmp_path):
    """A search on a SQLite study was killed (-9) after 2 trials, a third RUNNING (its process gone) and its jobs'
    folders 0-2 in the sweep folder. The same command marks the dead trial FAILED (it does not count), runs the 2
    trials left to n_trials=4 into new folders (3, 4: a finished folder is never taken for a new trial) and leaves no
    RUNNING trial."""
    import subprocess
    import sys

    import optuna
    from optuna.distributions import FloatDistribution

    from conftest import run_here
    from runner.sweeps.search import DEAD, OWNER

    sweep, db = tmp_path / "sweep", f"sqlite:///{tmp_path / 'search.db'}"
    study = optuna.create_study(storage=db, study_name="s", direction="minimize")
    lr = {"optimizer.lr": FloatDistribution(0.0001, 0.01, log=True)}
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    owner = {"host": __import__("socket").gethostname(), "pid": int(gone.stdout)}  # a process that has ended
    for job, value in enumerate((9.0, 8.0)):
        study.add_trial(
            optuna.trial.create_trial(
                params={"optimizer.lr": 0.001},
                distributions=lr,
                value=value,
                user_attrs={"sweep": str(sweep), "job": job, OWNER: owner},
            )
        )
    killed = study.ask(lr)
    for key, value in (("sweep", str(sweep)), ("job", 2), (OWNER, owner)):
        killed.set_user_attr(key, value)
    for job in range(3):
        (sweep / str(job)).mkdir(parents=True)
    proc = run_here(
        "-m",
        "hydra/sweeper=search",
        "hydra.sweeper.n_trials=4",
        "trainer.doctor=false",
        *TINY,
        "+hydra.sweeper.params={optimizer.lr: 'tag(log, interval(0.0001, 0.01))'}",
        "optimized_metric=eval_loss",
        "hydra.sweeper.verify_seeds=0",
        f"hydra.sweeper.storage={db}",
        "hydra.sweeper.study_name=s",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "1 trial(s) of a search that died" in proc.stdout and "trial 3/4:" in proc.stdout
    trials = optuna.load_study(study_name="s", storage=db).trials
    states = [t.state.name for t in trials]
    assert states == ["COMPLETE", "COMPLETE", "FAIL", "COMPLETE", "COMPLETE"], states
    assert trials[2].user_attrs["note"] == DEAD
    assert [t.user_attrs["job"] for t in trials[3:]] == [3, 4]
    assert all((sweep / str(job) / "summary.json").is_file() for job in (3, 4))


@pytest.mark.optuna
def test_two_searches_on_one_study_ask_no_point_twice_and_share_n_trials(tmp_path):
    """Another search with the same seed is running the sampler's first point on the shared study (a live process
    owns it): this search's first ask draws that same point, is told FAILED as taken and asks again, so no point is
    asked twice; the other's running trial counts, so n_trials=2 runs one trial here."""
    import subprocess
    import sys

    import optuna

    from conftest import run_here
    from runner.sweeps.search import OWNER, TAKEN, search_space

    space, _ = search_space({"optimizer.lr": "tag(log, interval(0.0001, 0.01))"}, [])
    first = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=7)).ask(space).params
    db = f"sqlite:///{tmp_path / 'search.db'}"
    study = optuna.create_study(
        storage=db, study_name="s", direction="minimize", sampler=optuna.samplers.TPESampler(seed=7)
    )  # the other search's
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        running = study.ask(space)
        assert running.params == first
        for key, value in (
            ("sweep", str(tmp_path / "theirs")),
            ("job", 0),
            (OWNER, {"host": __import__("socket").gethostname(), "pid": other.pid}),
        ):
            running.set_user_attr(key, value)
        proc = run_here(
            "-m",
            "hydra/sweeper=search",
            "hydra.sweeper.n_trials=2",
            "trainer.doctor=false",
            *TINY,
            "+hydra.sweeper.params={optimizer.lr: 'tag(log, interval(0.0001, 0.01))'}",
            "hydra.sweeper.sampler.seed=7",
            "optimized_metric=eval_loss",
            "hydra.sweeper.verify_seeds=0",
            f"hydra.sweeper.storage={db}",
            "hydra.sweeper.study_name=s",
            f"hydra.sweep.dir={tmp_path / 'mine'}",
            cwd=tmp_path,
        )
    finally:
        other.kill()
        other.wait()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    trials = optuna.load_study(study_name="s", storage=db).trials
    assert [(t.state.name, t.user_attrs.get("note")) for t in trials[1:]] == [("FAIL", TAKEN), ("COMPLETE", "")]
    assert trials[1].params == first and trials[2].params != first


@pytest.mark.optuna
def test_the_search_says_when_its_pruner_starts_to_act():
    """Optuna's median pruner waits for 5 finished trials: a 6-trial search can stop only the last one and a 4-trial
    search none, which the search says at its start (a user saw pruner=median prune 0 of 6 trials, unexplained)."""
    import optuna

    from runner.sweeps.pruning import acts_when

    assert acts_when(optuna.pruners.MedianPruner(), 6).endswith("it can stop only trial 6")
    assert acts_when(optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=5000), 6).startswith(
        "MedianPruner acts once 2 trials have finished (n_startup_trials), at evaluations past 5,000 samples"
    )
    none = acts_when(optuna.pruners.MedianPruner(), 4)
    assert "n_trials=4 it stops none" in none and "n_startup_trials: <fewer>" in none
