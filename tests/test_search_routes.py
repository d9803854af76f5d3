"""The recipe search past one machine (docs/tuners-and-doctor.md, "Past one machine: Kubeflow and SkyPilot"):
scripts/k8s/search.yaml (two Kubeflow Trainer TrainJobs, the workers then the verification) and
scripts/sky/search-pool.yaml + search-job.yaml (a SkyPilot pool and the job its workers run). No cluster or cloud is
reachable from here, so each file is parsed, every ``python -m runner`` command in it is taken out with its variables
given placeholder values, and composed as the search starts it: Hydra with Hydra's own config, runner's checks, the
search sweeper built from its settings and its plan made. A command naming an unknown key, option or search file
fails here, not on a rented node; so does a route whose commands stopped sharing one study."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

from runner import REPO_ROOT

K8S = REPO_ROOT / "scripts" / "k8s" / "search.yaml"
SKY_POOL = REPO_ROOT / "scripts" / "sky" / "search-pool.yaml"
SKY_JOB = REPO_ROOT / "scripts" / "sky" / "search-job.yaml"

#: What a secret holds on the cluster: a URL with the characters a password may hold (Hydra reads ',' and '=')
STORAGE = "postgresql://runner:p=a,ss@db.example.com:5432/optuna"
#: Variables the platforms set themselves, by name
PLATFORM = {"SKYPILOT_JOB_RANK": "0", "SKYPILOT_NUM_JOBS": "4"}


def runner_commands(node) -> list[list[str]]:
    """Every ``python -m runner ...`` command in a parsed YAML document, as argument lists, variables as written: a
    list of strings holding ``-m runner`` (a container's command), or the lines of a string that start one (a
    shell script, its ``\\``-continued lines joined)."""
    found = []
    if isinstance(node, dict):
        for value in node.values():
            found += runner_commands(value)
    elif isinstance(node, list):
        if all(isinstance(x, str) for x in node) and any(node[i : i + 2] == ["-m", "runner"] for i in range(len(node))):
            found.append(list(node))
        else:
            for value in node:
                found += runner_commands(value)
    elif isinstance(node, str):
        for line in node.replace("\\\n", " ").splitlines():
            if re.search(r"(^|\s)python3? -m runner(\s|$)", line):
                found.append(line.strip())  # split once its variables have values (a shell splits after expanding)
    return found


def expand(text: str, values: dict[str, str]) -> str:
    """``$NAME``, ``${NAME}`` (a shell) and ``$(NAME)`` (Kubernetes, in a container's command) as ``values`` has
    them; a variable it lacks fails (a command that uses one its file never defines)."""

    def value(m: re.Match) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        assert name in values, f"{text!r}: ${name} is set nowhere in its file ({', '.join(values)})"
        return values[name]

    return re.sub(r"\$\((\w+)\)|\$\{(\w+)\}|\$(\w+)", value, text)


def overrides(argv: list[str]) -> list[str]:
    """What follows ``-m runner``."""
    at = next(i for i in range(len(argv) - 1) if argv[i : i + 2] == ["-m", "runner"])
    assert argv[0].startswith("python"), argv
    return argv[at + 2 :]


def compose_search(args: list[str]):
    """Compose ``python -m runner <args>`` as the search starts: the job config passes runner's checks, and the
    search sweeper, built from the composed ``hydra.sweeper`` (an unknown setting is a TypeError), makes its plan
    (metric, space, verification seeds). The composed config."""
    from runner.engine.validate import validate
    from runner.sweeps.search import make_sweeper
    from runner.techniques import variants

    variants.register()
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=args, return_hydra_config=True)
    settings = OmegaConf.to_container(cfg.hydra.sweeper)
    assert settings.pop("_target_").endswith("SearchSweeper"), f"{args}: not the recipe search's sweeper"
    settings.pop("_recursive_", None)
    sweeper = make_sweeper(**settings)
    sweeper.config = cfg
    sweeper.plan([a for a in args if not a.startswith(("hydra.", "+hydra.", "hydra/"))])
    job = cfg.copy()
    with open_dict(job):
        del job["hydra"]
    validate(job)
    return cfg


def check_route(commands: list[list[str]]) -> None:
    """The pattern both routes follow: workers that search only (``verify_seeds=0``) and a last run that verifies
    (the file's seeds), all the same search on one shared study in the storage."""
    composed = [compose_search(overrides(c)) for c in commands]
    verify = [cfg.hydra.sweeper.verify_seeds for cfg in composed]
    assert 0 in verify and any(v > 0 for v in verify), f"no worker or no verifying run: verify_seeds {verify}"
    for cfg in composed:
        assert cfg.hydra.sweeper.storage == STORAGE and cfg.hydra.sweeper.study_name, "not the shared study"
    shared = [[a for a in overrides(c) if not a.startswith("hydra.sweeper.verify_seeds=")] for c in commands]
    assert all(s == shared[0] for s in shared), f"the workers and the verification run different searches: {shared}"
    assert "hparams_search=mnist_optuna" in shared[0]


def test_kubeflow_trainjobs_run_workers_then_the_verification():
    jobs = list(yaml.safe_load_all(K8S.read_text()))
    assert [(j["apiVersion"], j["kind"]) for j in jobs] == [("trainer.kubeflow.org/v1alpha1", "TrainJob")] * 2
    steps = {j["metadata"]["labels"]["runner.search/step"]: j for j in jobs}
    assert set(steps) == {"workers", "verify"}  # kubectl apply -l runner.search/step=... (the file's usage)
    assert steps["workers"]["spec"]["trainer"]["numNodes"] > 1 and steps["verify"]["spec"]["trainer"]["numNodes"] == 1
    commands = []
    for job in jobs:
        spec = job["spec"]
        assert spec["runtimeRef"]["name"] == "torch-distributed"
        env = {e["name"]: e for e in spec["trainer"]["env"]}
        assert env["RUNNER_STUDY_STORAGE"]["valueFrom"]["secretKeyRef"]["name"] == "runner-study"
        (command,) = runner_commands(spec)
        assert command[0] == "python", "one search process per pod, not torchrun"
        values = {name: STORAGE if "valueFrom" in e else str(e["value"]) for name, e in env.items()}
        commands.append([expand(a, values) for a in command])  # no shell: Kubernetes' $(VAR), one argument each
    check_route(commands)
    usage = K8S.read_text().split("\napiVersion")[0]  # the header: the names it waits on and reads the logs of
    assert all(f"trainjob/{j['metadata']['name']}" in usage or f"={j['metadata']['name']}" in usage for j in jobs)


def documented_envs(path: Path) -> list[dict[str, str]]:
    """The ``--env NAME=VALUE`` sets of the usage lines in ``path``'s header (one per ``sky jobs launch`` line)."""
    return [
        dict(re.findall(r"--env (\w+)=(\S+)", line))
        for line in path.read_text().splitlines()
        if line.startswith("#") and "sky jobs launch" in line
    ]


def test_skypilot_pool_and_job_run_workers_then_the_verification():
    pool = yaml.safe_load(SKY_POOL.read_text())
    assert pool["pool"]["workers"] > 1 and "run" not in pool  # a pool YAML may have no run section
    assert "pip install" in pool["setup"] and ".[hpo]" in pool["setup"] and pool["workdir"] == "."
    job = yaml.safe_load(SKY_JOB.read_text())
    assert not {"setup", "workdir", "file_mounts"} & set(job)  # a pool's job may not have them
    assert job["resources"] == pool["resources"]  # each job takes a whole worker
    assert "cd ~/sky_workdir" in job["run"]  # where the pool's workdir is synced
    assert set(job["secrets"]) == {"RUNNER_STUDY_STORAGE"}
    launches = documented_envs(SKY_JOB)
    assert len(launches) == 2, "the usage: the workers' launch, then the verifying one"
    (command,) = runner_commands(job)
    commands = []
    for extra in launches:
        values = {**PLATFORM, **{k: str(v) for k, v in job["envs"].items()}, "RUNNER_STUDY_STORAGE": STORAGE, **extra}
        commands.append(shlex.split(expand(command, values)))  # a shell expands, then splits
    check_route(commands)


@pytest.mark.parametrize(
    "bad",
    ["hydra.sweeper.verify_seed=0", "hparams_search=mnist_optun", "trainer.max_epoch=1", "+hydra.sweeper.n_trial=4"],
)
def test_a_wrong_override_in_a_route_fails_to_compose(bad):
    """What the tests above catch: an unknown key, a search file that does not exist, a sweeper setting the search
    does not take."""
    from hydra.errors import HydraException

    from runner.errors import ConfigError

    good = ["hparams_search=mnist_optuna", f"hydra.sweeper.storage='{STORAGE}'", "hydra.sweeper.study_name=s"]
    compose_search(good)
    with pytest.raises((HydraException, TypeError, ConfigError)):
        compose_search([a for a in good if a.split("=")[0] != bad.split("=")[0]] + [bad])
