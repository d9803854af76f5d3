"""``hydra/sweeper=search``: search the training recipe with Optuna (>= 5, its ask-and-tell interface) as a Hydra
sweeper, then verify the best trial against the starting recipe on fresh seeds.

    python -m runner -m hparams_search=mnist_optuna            # conf/hparams_search/mnist_optuna.yaml

The search file has lightning-hydra-template's shape and the Optuna sweeper plugin's keys and grammar
(``interval(a, b)``, ``tag(log, ...)``, ``choice(...)``, ``range(a, b, step)``), so it runs under the released plugin
too where that installs; why not the plugin (hydra-optuna-sweeper 1.3.0 pins optuna < 3), and the file's keys:
docs/tuners-and-doctor.md, "Searching the recipe".

Each trial is one job of the sweep (``<sweep>/<n>``); its ``optimized_metric`` (runner/objective.py) is told to
the study; the best trial is then verified against the starting recipe on fresh seeds (runner/sweeps/search_end.py).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, Transformer
from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.sweeper import Sweeper
from omegaconf import DictConfig, OmegaConf

from runner import objective
from runner.errors import ConfigError
from runner.objective import BASIC_LAUNCHER
from runner.sweeps import pruning, search_verify
from runner.sweeps.search_end import RUN, finish, job_folder
from runner.sweeps.search_verify import override_line
from runner.sweeps.slots import Slots, job_return, threads_each

#: The pip command that brings Optuna (the ``hpo`` extra)
INSTALL = 'pip install -e ".[hpo]" (or pip install "optuna>=5")'
#: The oldest Optuna whose TPE asks the trials the search files' seeds record (tests/data/mnist_optuna_trials.json):
#: each 4.x release asked other points from the sixth trial on, whatever the sampler's options
OLDEST = (5, 0)


def fail(message: str) -> None:
    """One ``error:`` line and exit status 2, as ``python -m runner`` answers bad input."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def make_sweeper(**settings: Any) -> "SearchSweeper":
    """The sweeper Hydra instantiates from conf/hydra/sweeper/search.yaml; one line where Optuna is missing or
    older than ``OLDEST``."""
    try:
        import optuna
    except ImportError:
        fail(f"hydra/sweeper=search needs Optuna, which is not installed: {INSTALL}")
    found = tuple(int(p) for p in optuna.__version__.split(".")[:2] if p.isdigit())
    if found < OLDEST:
        fail(
            f"hydra/sweeper=search needs Optuna >= {'.'.join(map(str, OLDEST))}, found {optuna.__version__} (older "
            f"releases' TPE asks other trials with the same seed and options): {INSTALL}"
        )
    return SearchSweeper(**settings)


def distribution(override: Override) -> Any:
    """The Optuna distribution of one sweep override (``interval``, ``tag(log, interval)``, ``choice``, ``range``),
    or None for a plain value (fixed for every trial)."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    if not override.is_sweep_override():
        return None
    if override.is_choice_sweep() or override.is_range_sweep():  # a range: its values, as Hydra lists them
        return CategoricalDistribution(list(override.sweep_iterator(transformer=Transformer.encode)))
    if override.is_interval_sweep():
        sweep = override.value()
        log = "log" in sweep.tags
        if isinstance(sweep.start, int) and isinstance(sweep.end, int):
            return IntDistribution(sweep.start, sweep.end, log=log)
        return FloatDistribution(float(sweep.start), float(sweep.end), log=log)
    raise ConfigError(
        f"{override.input_line}: the search takes interval(a, b), tag(log, interval(a, b)), "
        f"choice(a, b, ...) or range(a, b, step)"
    )


def search_space(params: dict[str, str], arguments: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    """``(name -> distribution, the fixed overrides)`` from ``hydra.sweeper.params`` and the command line (whose
    sweep overrides join the space; a plain one fixes the value, and wins over the file's range)."""
    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()] + list(arguments))
    space, fixed = {}, []
    for override in parsed:
        key = override.get_key_element()
        found = distribution(override)
        if found is not None:
            space[key] = found
        else:
            space.pop(key, None)
            fixed.append(override.input_line)
    return space, fixed


def trial_outcome(ret: JobReturn, metric: str) -> tuple[float | None, bool, str]:
    """``(value told to the study or None for a failed trial, reached the target, a note)`` of one trial's job."""
    if ret.status != JobStatus.COMPLETED:
        return None, False, f"failed: {type(ret._return_value).__name__}: {ret._return_value}"
    value = ret.return_value
    summary = summary_of(ret)
    reached = objective.reached(summary)
    if value is None or not math.isfinite(float(value)):
        return None, reached, f"no {metric} (diverged, or the run has no such figure)"
    note = (
        ""
        if metric not in objective.TO_TARGET
        else "reached the target"
        if reached
        else f"target not reached: {objective.CENSORED_FACTOR:g} x what it spent"
    )
    return float(value), reached, note


def summary_of(ret: JobReturn) -> dict[str, Any]:
    """The trial's ``summary.json`` ({} when its job wrote none: it failed)."""
    path = job_folder(ret) / "summary.json"
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}


class SearchSweeper(Sweeper):
    """Hydra's ``Sweeper`` interface: ``setup`` (the launcher), then ``sweep`` with the command line's overrides."""

    def __init__(
        self,
        sampler: Any = None,
        direction: str | None = None,
        n_trials: int = 20,
        storage: str | None = None,
        study_name: str | None = None,
        params: Any = None,
        verify_seeds: int = 5,
        verify_first_seed: int = 100,
        confidence: float = 0.95,
        recipe: Sequence[str] = (),
        n_jobs: int = 1,
        pruner: Any = None,
        verify_candidates: int = 1,
    ) -> None:
        self.sampler, self.direction, self.n_trials, self.n_jobs = sampler, direction, n_trials, n_jobs
        self.pruner = pruner  # a name of pruning.NAMES or an Optuna pruner's node; None: every trial runs to its end
        self.recipe = [str(o) for o in recipe or ()]  # the overrides that give the search file's own preset
        self.storage, self.study_name = storage, study_name
        self.params = OmegaConf.to_container(params) if isinstance(params, DictConfig) else dict(params or {})
        self.verify_seeds, self.verify_first_seed, self.confidence = verify_seeds, verify_first_seed, confidence
        self.verify_candidates = verify_candidates
        self.started = time.monotonic()  # when the search began (``sweep``): its wall time and the verification's share
        self.busy_share: float | None = None  # of the slots' time the trials used (``in_slots_run``)
        self.pending: Slots | None = None  # the slots, with the verification's runs started ahead (``in_slots_run``)
        self.ahead_done: dict[tuple[str, int], Path] = {}  # (side, seed) -> the folder of one that ended
        self.config: DictConfig | None = None
        self.hydra_context: Any = None
        self.launcher: Any = None
        self.job_idx = 0
        self.position: dict[int, int] = {}  # trial number -> its place among the n_trials, as printed

    def setup(self, *, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            config=config, hydra_context=hydra_context, task_function=task_function
        )

    def launch(self, overrides: list[list[str]]) -> Sequence[JobReturn]:
        returns = self.launcher.launch(overrides, initial_job_idx=self.job_idx)
        self.job_idx += len(returns)
        return returns

    def sweep(self, arguments: list[str]) -> None:
        self.started = time.monotonic()
        try:
            plan = self.plan(arguments)
        except ConfigError as e:
            fail(str(e))
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        if self.in_slots() and self.storage is None:  # trials in processes of their own open the study from there
            sweep_dir.mkdir(parents=True, exist_ok=True)
            self.storage = f"sqlite:///{sweep_dir.resolve() / 'study.db'}"
        study = self.study(plan["direction"])
        # trials report to it (pruning.py): in memory, those the basic launcher runs here; with a storage, every
        # trial opens it, in this process or another (submitit_slurm, slots.py)
        pruning.STUDY = study if self.storage is None else None
        dead = fail_dead_trials(study)
        if dead:
            print(
                f"note: {len(dead)} trial(s) of a search that died (killed) were still RUNNING in the study: "
                f"marked FAILED ({', '.join(str(n + 1) for n in dead)}); they do not count",
                flush=True,
            )
        self.job_idx = max(self.job_idx, next_job_index(sweep_dir))
        if pruning.active(self.pruner):
            print(f"pruning: {pruning.acts_when(study.pruner, self.n_trials)}", flush=True)
        summaries: list[dict[str, Any]] = []
        with heartbeat(study if self.storage is not None else None):
            run = self.in_slots_run if self.in_slots() else self.in_jobs if self.n_jobs > 1 else self.in_batches
        exhausted = run(study, plan, summaries)
        if exhausted:
            print("the sampler has tried every point of the space: the search ends here", flush=True)
        if pruning.active(self.pruner):
            count, seconds = pruning.saved(summaries)
            print(
                f"pruning ({pruning.name_of(self.pruner)}): {count} of {len(summaries)} trials "
                f"stopped early, saving about {seconds / 60:.1f} min of training and evaluation (their remaining "
                f"steps at their own pace)",
                flush=True,
            )
        finish(self, study, plan)

    def in_slots(self) -> bool:
        """Whether trials run ``n_jobs`` at a time in processes of their own (runner/sweeps/slots.py): ``n_jobs`` > 1
        on Hydra's basic launcher, which would run a batch one job after the other; another launcher (SLURM) gets
        each trial as a launch of its own (``in_jobs``)."""
        return self.n_jobs > 1 and OmegaConf.select(self.config, "hydra.launcher._target_") == BASIC_LAUNCHER

    def ask(self, study: Any, plan: dict[str, Any], job: int) -> Any:
        """A new trial, printed and named to its job (``job``: its number in the sweep folder)."""
        trial = ask_new_point(study, plan["space"])
        trial.set_user_attr("job", job)  # how its job finds it to report (pruning.listener)
        trial.set_user_attr("sweep", str(self.config.hydra.sweep.dir))
        self.position[trial.number] = counted(study)  # its place among the n_trials (it counts itself, running)
        print(
            f"\ntrial {self.position[trial.number]}/{self.n_trials}: {' '.join(override_line(trial.params))}",
            flush=True,
        )
        return trial

    def told(self, study: Any, trial: Any, ret: JobReturn, plan: dict[str, Any], summaries: list) -> bool:
        """Tell the study how ``trial``'s job ``ret`` ended, print it; whether the sampler has exhausted the space."""
        value, reached, note = trial_outcome(ret, plan["metric"])
        summaries.append(summary_of(ret))
        pruned = str(summaries[-1].get("stopped_early") or "").startswith(pruning.PRUNED)
        if pruned:
            samples = (summaries[-1].get("steps") or 0) * (summaries[-1].get("global_batch_size") or 0)
            value, note = None, f"pruned at {samples:,} samples: censored there"  # not "not reached": cut
        trial.set_user_attr("reached", reached)
        trial.set_user_attr("note", note)
        if value is not None:  # the record that makes it the search's own (search_end.own): a planted row has none
            trial.set_user_attr(RUN, {"folder": str(job_folder(ret).resolve()), "value": value})
        exhausted = tell(study, trial, value, pruned)
        print(
            f"trial {self.position[trial.number]}: {plan['metric']} = {value if value is not None else '-'}"
            f"{f' ({note})' if note else ''}",
            flush=True,
        )
        return exhausted

    def in_batches(self, study: Any, plan: dict[str, Any], summaries: list) -> bool:
        """One trial a launch through Hydra's launcher (``n_jobs`` 1), told when it returns."""
        exhausted = False
        while (left := self.n_trials - counted(study)) > 0 and not exhausted:
            trials = [self.ask(study, plan, self.job_idx + i) for i in range(min(self.n_jobs, left))]
            returns = self.launch([plan["fixed"] + override_line(t.params) for t in trials])
            for trial, ret in zip(trials, returns):
                exhausted = self.told(study, trial, ret, plan, summaries) or exhausted
        return exhausted

    def in_jobs(self, study: Any, plan: dict[str, Any], summaries: list) -> bool:
        """``n_jobs`` trials at once through a launcher that runs jobs elsewhere (``submitit_slurm``): each trial
        is a launch of its own from one of ``n_jobs`` threads, told as it returns, and the next trial is launched
        at once (one launch of ``n_jobs`` would be a job array whose slowest job holds the others' slots). The
        threads are daemons: a search stopped by Ctrl-C does not wait for its jobs to end."""
        import queue

        ended: queue.Queue = queue.Queue()
        exhausted, running = False, 0

        def launch(trial: Any, argv: list[str], job: int) -> None:
            try:
                ended.put((trial, self.launcher.launch([argv], initial_job_idx=job)[0], None))
            except BaseException as e:  # noqa: BLE001 - raised in the search's own thread below
                ended.put((trial, None, e))

        while True:
            while not exhausted and running < self.n_jobs and self.n_trials - counted(study) > 0:
                trial = self.ask(study, plan, self.job_idx)
                threading.Thread(
                    target=launch,
                    args=(trial, plan["fixed"] + override_line(trial.params), self.job_idx),
                    name="search-trial",
                    daemon=True,
                ).start()
                trial.set_user_attr("started", time.time())
                running, self.job_idx = running + 1, self.job_idx + 1
            if not running:
                return exhausted
            trial, ret, error = ended.get()
            running -= 1
            if error is not None:
                raise error
            exhausted = self.told(study, trial, ret, plan, summaries) or exhausted

    def in_slots_run(self, study: Any, plan: dict[str, Any], summaries: list) -> bool:
        """``n_jobs`` trials at a time, each in a process of its own; a slot that frees starts the next trial at
        once, and once no trial is left to ask, the verification's runs of the starting recipe (``ahead``: they do
        not depend on which trial is best), left running for it in ``self.pending``. Ends with the share of
        slot-time used."""
        slots, exhausted = self.slots(), False
        sweep = Path(str(self.config.hydra.sweep.dir))
        pruner = OmegaConf.to_container(self.pruner) if isinstance(self.pruner, DictConfig) else self.pruner
        where = {
            "storage": str(self.storage),
            "study_name": str(pruning.study_name(self.study_name, self.storage)),
            "pruner": pruner,
        }
        ahead = search_verify.ahead(self, plan)
        try:
            while True:
                while not exhausted and len(slots.running) < self.n_jobs and self.n_trials - counted(study) > 0:
                    trial = self.ask(study, plan, self.job_idx)
                    slots.start(
                        trial,
                        sweep / str(self.job_idx),
                        plan["fixed"] + override_line(trial.params),
                        trial=where | {"trial_id": trial._trial_id},
                    )
                    trial.set_user_attr("started", time.time())  # wall clock, as the study's own datetime_start
                    self.job_idx += 1
                while ahead and len(slots.running) < self.n_jobs and (exhausted or counted(study) >= self.n_trials):
                    key, folder, argv = ahead.pop(0)  # a slot no trial will take: the start's verification runs
                    print(
                        f"verification run ahead: the starting recipe on seed {key[1]} (a slot no trial will take)",
                        flush=True,
                    )
                    slots.start(key, folder, argv)
                if not any(not isinstance(r.key, tuple) for r in slots.running):
                    break
                done, code = slots.wait_one()
                if isinstance(done.key, tuple):  # a verification run: search_verify.runs reads it
                    self.ahead_done[done.key] = done.folder
                    continue
                exhausted = (
                    self.told(study, done.key, job_return(done.folder, code, plan["metric"]), plan, summaries)
                    or exhausted
                )
        except BaseException:
            slots.stop()
            raise
        self.pending = slots
        used = slots.utilization()
        if used is not None:
            self.busy_share = used
            print(f"slots: {self.n_jobs} trials at a time, busy {used:.0%} of the slot-time", flush=True)
        return exhausted

    def slots(self) -> Slots:
        """``n_jobs`` slots, each job's threads the CPUs shared out where ``trainer.num_threads`` is null (said)."""
        threads = threads_each(self.config, self.n_jobs)
        if threads is not None:
            print(
                f"slots: {self.n_jobs} jobs at a time, each with trainer.num_threads={threads} (this process's "
                f"CPUs shared out; set trainer.num_threads to choose)",
                flush=True,
            )
        return Slots(self.n_jobs, threads)

    def plan(self, arguments: list[str]) -> dict[str, Any]:
        """The metric, direction, search space, fixed overrides and verification seeds of this search.

        Raises:
            ConfigError: no or a bad ``optimized_metric``, an empty space, a direction against the metric, or
                verification seeds that include the search's seed.
        """
        cfg = self.config
        metric = cfg.get("optimized_metric")
        if metric is None:
            raise ConfigError(
                f"hydra/sweeper=search needs optimized_metric=<figure to optimize>: one of "
                f"{', '.join(objective.METRICS)} (e.g. in conf/hparams_search/mnist_optuna.yaml)"
            )
        objective.check(cfg)
        direction = self.direction or objective.METRICS[metric]
        if direction not in ("minimize", "maximize"):
            raise ConfigError(
                f"hydra.sweeper.direction={direction} must be minimize, maximize or null (the "
                f"direction in which {metric} is better: {objective.METRICS[metric]})"
            )
        if self.n_trials < 1:
            raise ConfigError(f"hydra.sweeper.n_trials={self.n_trials} must be >= 1 (the trials the search runs)")
        if self.n_jobs < 1:
            raise ConfigError(f"hydra.sweeper.n_jobs={self.n_jobs} must be >= 1 (the trials launched at once)")
        if not isinstance(self.verify_candidates, int) or self.verify_candidates < 1:
            raise ConfigError(f"hydra.sweeper.verify_candidates={self.verify_candidates} must be an integer >= 1")
        if self.n_jobs > 1 and "InterleavedLauncher" in str(self.config.hydra.launcher.get("_target_", "")):
            raise ConfigError(
                "hydra.sweeper.n_jobs > 1 with hydra/launcher=interleaved: the interleaved launcher "
                "compares jobs, it does not run trials; use the basic launcher or submitit_slurm"
            )
        pruning.build(self.pruner)  # an unknown name or a node that does not build: one line
        if pruning.active(self.pruner) and pruning.figure(cfg) is None:
            raise ConfigError(
                f"hydra.sweeper.pruner stops trials on their evaluations, but optimized_metric={metric} "
                f"is no evaluation figure: prune a search for time_to_target_s, eval_loss or "
                f"eval_accuracy, or set hydra.sweeper.pruner=null"
            )
        space, fixed = search_space(self.params, arguments)
        if not space:
            raise ConfigError(
                "nothing to search: give hydra.sweeper.params (key: interval(a, b) | choice(a, b) "
                "| ...) in an hparams_search file, or a sweep such as 'optimizer.lr=interval(0.01,0.5)'"
            )
        seeds = list(range(self.verify_first_seed, self.verify_first_seed + max(self.verify_seeds, 0)))
        if cfg.trainer.seed in seeds:
            raise ConfigError(
                f"trainer.seed={cfg.trainer.seed} (the search's seed) is one of the verification "
                f"seeds {seeds[0]}..{seeds[-1]}: verification needs fresh seeds; move "
                f"hydra.sweeper.verify_first_seed past it"
            )
        return {"metric": metric, "direction": direction, "space": space, "fixed": fixed, "seeds": seeds}

    def study(self, direction: str) -> Any:
        import optuna
        from hydra.utils import instantiate

        optuna.logging.set_verbosity(optuna.logging.WARNING)  # runner prints one line per trial itself
        sampler = instantiate(self.sampler) if self.sampler is not None else None
        pruner = pruning.build(self.pruner)
        name = pruning.study_name(self.study_name, self.storage)
        try:
            return optuna.create_study(
                sampler=sampler,
                pruner=pruner,
                direction=direction,
                storage=self.storage,
                study_name=name,
                load_if_exists=self.storage is not None,
            )
        except Exception as e:  # noqa: BLE001 - an unopenable URL or file: one line, not Optuna's traceback
            fail(
                f"hydra.sweeper.storage={self.storage} cannot be opened ({type(e).__name__}: {e}); give a URL "
                f"Optuna opens, e.g. sqlite:///search.db, or null for a study in memory"
            )


#: A trial's user attribute naming the search process that asked it: ``{"host": ..., "pid": ...}``
OWNER = "search_process"
#: What a trial of a dead search is told (its note)
DEAD = "its search process died before the trial ended"
#: What a point another search sharing the study had asked already is told (its note), before it is asked again
TAKEN = "another search of the study asked this point already"
#: A trial's user attribute: when its search process last said it was alive (``time.time()``; ``heartbeat``)
HEARTBEAT = "heartbeat"
#: Seconds between a search's heartbeats, and the age past which another host's trial is taken as dead
BEAT_S, STALE_S = 30.0, 300.0
#: How many times a point another search holds is asked again, reseeded, before it is run anyway
REASKS = 5


def _mine() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid()}


def ask_new_point(study: Any, space: dict[str, Any]) -> Any:
    """``study.ask(space)``, marked as this process's, asked again (the sampler reseeded) while another search
    sharing the study has the same point: two searches with one seed draw the same startup points, and ran them
    twice (a taken point is told FAILED with the note ``TAKEN``; it does not count)."""
    from optuna.trial import TrialState

    for attempt in range(REASKS + 1):
        trial = study.ask(space)
        trial.set_user_attr(OWNER, _mine())
        others = [
            t
            for t in study.get_trials(deepcopy=False)
            if t.number != trial.number
            and t.user_attrs.get(OWNER) not in (None, _mine())
            and t.user_attrs.get("note") not in (DEAD, TAKEN)
        ]
        if attempt == REASKS or all(t.params != trial.params for t in others):
            return trial
        trial.set_user_attr("note", TAKEN)
        study.tell(trial, state=TrialState.FAIL)
        study.sampler.reseed_rng()
    raise AssertionError("unreachable")


@contextlib.contextmanager
def heartbeat(study: Any, every_s: float = BEAT_S) -> Iterator[None]:
    """While the block runs, a thread stamps ``HEARTBEAT`` (``time.time()``) on this process's RUNNING trials of
    ``study`` every ``every_s`` seconds, so a search on another host can tell a dead one's trials (``_alive``); a
    study in memory (None) needs none. A stamp that fails (a busy database) waits for the next."""
    if study is None:
        yield
        return
    from optuna.trial import TrialState

    done = threading.Event()

    def beat() -> None:
        while not done.wait(every_s):
            try:
                for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
                    if t.user_attrs.get(OWNER) == _mine():
                        study._storage.set_trial_user_attr(t._trial_id, HEARTBEAT, time.time())
            except Exception:  # noqa: BLE001 - e.g. sqlite's "database is locked": the next beat stamps it
                continue

    thread = threading.Thread(target=beat, name="search-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _alive(owner: Any, beat: float | None = None) -> bool:
    """Whether the search process ``owner`` (``OWNER``'s value) may still be running: on this host, whether its
    process exists; on another, whether its trial's last ``HEARTBEAT`` (``beat``) is younger than ``STALE_S``
    (a trial with none, from a runner before heartbeats, is taken as alive)."""
    if not isinstance(owner, dict) or owner.get("host") != socket.gethostname():
        return beat is None or time.time() - float(beat) < STALE_S
    try:
        os.kill(int(owner["pid"]), 0)
    except ProcessLookupError:
        return False
    except (OSError, ValueError, TypeError, KeyError):
        return True
    return True


def fail_dead_trials(study: Any) -> list[int]:
    """Mark FAILED the RUNNING trials of the study whose search process is gone (killed with -9: it never told
    them): on this host, its process; on another, no ``HEARTBEAT`` for ``STALE_S``; their numbers. Trials of a live
    search (another one sharing the study) are left alone."""
    from optuna.trial import TrialState

    dead = [
        t
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        if OWNER in t.user_attrs and not _alive(t.user_attrs[OWNER], t.user_attrs.get(HEARTBEAT))
    ]
    for t in dead:
        study._storage.set_trial_user_attr(t._trial_id, "note", DEAD)
        study.tell(t.number, state=TrialState.FAIL)
    return [t.number for t in dead]


def counted(study: Any) -> int:
    """The trials that count towards ``n_trials``: those that ended (complete, pruned, failed by their own run),
    and those a live search sharing the study is running now; never one of a dead search."""
    from optuna.trial import TrialState

    ended = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
    return sum(
        1
        for t in study.get_trials(deepcopy=False)
        if "sweep" in t.user_attrs  # asked by a search of runner's
        and (
            (t.state in ended and t.user_attrs.get("note") not in (DEAD, TAKEN))
            or (t.state == TrialState.RUNNING and _alive(t.user_attrs.get(OWNER), t.user_attrs.get(HEARTBEAT)))
        )
    )


def next_job_index(sweep: Path) -> int:
    """The first job number after the job folders already in ``sweep`` (a rerun into the same sweep folder): a new
    trial never lands in, nor is taken for, an earlier trial's finished folder."""
    numbers = [int(p.name) for p in sweep.iterdir() if p.is_dir() and p.name.isdigit()] if sweep.is_dir() else []
    return max(numbers, default=-1) + 1


def tell(study: Any, trial: Any, value: float | None, pruned: bool = False) -> bool:
    """Tell the study a trial's value (None: the trial failed, or was ``pruned``); whether the sampler has exhausted
    the space.

    A grid or brute-force sampler ends a study by calling ``Study.stop``, which outside ``study.optimize`` raises
    a RuntimeError after the trial is stored (optuna/study/_tell.py stores it in a ``finally``)."""
    from optuna.trial import TrialState

    try:
        state = TrialState.PRUNED if pruned else None if value is not None else TrialState.FAIL
        study.tell(trial, None if pruned else value, state=state)
    except RuntimeError as e:
        if "Study.stop" not in str(e):
            raise
        return True
    return False
