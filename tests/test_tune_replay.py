"""The speed tuner's rules replayed on recorded rounds (issue 61): every decision of the search (the guard's verdicts
aside, which are recorded) is a function of what its rounds measured, so a recorded search's ``interleave.json``
records, read back through ``runner.compare.read``, must lead today's rules to the rounds that were measured and to
the pick that was recommended. A rule changed to fit one benchmark run then fails here on the others.

The recorded sets (``tests/data/tuner_rounds/<name>/``: the tuner's ``config.yaml``, its ``speed.json`` rows and
pick, one ``round<N>.json`` per round and ``verification.json``) come from real ``python -m runner.tune speed`` runs:

- ``epyc-gpt-8min``: the Shakespeare GPT (``+experiment=shakespeare_char tune.budget_minutes=8``) on a 2-core AMD
  EPYC, 2026-12-06: round 1 and the verification (no elimination round fitted the budget); rules changed since.
- ``epyc-gpt-8min-today``: the same command on 2026-12-07: the guard and the verification only (no round fitted).
- ``epyc-gpt-12min``: ``tune.budget_minutes=12`` on 2026-12-07: round 1, one elimination round, the verification.

Add a set by copying a tuner folder's ``.hydra/config.yaml``, ``speed.json`` and ``rounds/*/interleave.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from runner import compare
from runner.tune import speed
from runner.tune.rounds import Round, read_round
from runner.tune.switches import Switch

RECORDED = Path(__file__).parent / "data" / "tuner_rounds"
SETS = sorted(p.name for p in RECORDED.iterdir() if p.is_dir())


class Diverged(AssertionError):
    """The replayed search asked for a round the recorded one did not measure."""


class Replay(speed._Search):
    """The search with its measurements read from a recorded set: a round is the record of the same number (its jobs
    must be the ones the rules ask for), the guard's verdicts are the recorded rows', and the budget is no limit (a
    round the recorded search had no time for is not measured here either)."""

    def __init__(self, recorded: Path, tmp_path: Path):
        self.recorded = recorded
        self.spec = json.loads((recorded / "speed.json").read_text())
        cfg = OmegaConf.load(recorded / "config.yaml")
        device = torch.device("cpu" if cfg.trainer.device == "auto" else cfg.trainer.device)
        env = SimpleNamespace(distributed=False, is_main=True, device=device)
        super().__init__(cfg, env, tmp_path)
        self.store = SimpleNamespace(save=lambda: None)
        self.guarded_rows = {r["switch"]: r for r in self.spec["rows"] if r["stage"] == "guard"}

    def wall_left(self) -> float:
        return float("inf")

    def guard(self, sw: list[Switch]) -> tuple[float, float | None, str | None]:
        """The recorded verdict; a combination the recorded search did not guard passes where each of its switches
        passed alone (the guard measures, it does not decide: the replay is of the rules)."""
        row = self.guarded_rows.get("+".join(s.name for s in sw))
        if row is None and len(sw) > 1:
            return max(self.guard([s])[0] for s in sw), None, None
        if row is None:
            raise Diverged(f"the guard of {sw[0].name} was not recorded")
        passed = row["verdict"] == "passed" or row["verdict"].startswith("not needed")
        return (0.0 if passed else float("inf")), row.get("guard_loss"), None

    def verify(self, incumbent: list[Switch], whole: list[Switch]) -> tuple[list[Switch], object]:
        """The recorded verification, where it measured the switches the rules verify (its ``pick`` and ``extended``
        are names: the recorded rows say what they held)."""
        asked = [speed._label(sw) for sw in (incumbent, whole) if sw and (sw is incumbent or whole != incumbent)]
        measured = [
            r["switch"]
            for r in self.spec["rows"]
            if r["stage"] == "verification" and not r["switch"].startswith(("+experiment", "(yours"))
        ]
        if asked != measured:
            raise Diverged(f"verification: the rules verify {asked}; the recorded search measured {measured}")
        return super().verify(incumbent, whole)

    def round(self, title: str, reference: str, jobs: dict, share: float = 0.5) -> Round | None:
        path = self.recorded / f"round{len(self.rounds) + 1}.json"
        if not path.is_file():  # the recorded search ran out of time here
            self.notes.append(f"{title.split(':')[0]} not measured (not recorded)")
            return None
        r = replayed(Round(title, reference, jobs, minutes=0), path, self.settings.confidence)
        self.rounds.append(r)
        return r


def replayed(r: Round, path: Path, confidence: float) -> Round:
    """``r`` filled from the record at ``path``, as ``measure_round`` fills it from a live comparison."""
    record = json.loads(path.read_text())
    asked, measured = set(r.jobs) | {f"{r.reference}-aa"}, {j["config"] for j in record["jobs"].values()}
    if not asked <= measured:
        raise Diverged(f"{r.title}: the rules ask for {sorted(asked - measured)}, which {path.name} did not measure")
    return read_round(r, compare.read(record, confidence))


def replay(search: Replay, monkeypatch) -> tuple[Replay, list[Switch]]:
    """``search`` run on the candidates of its recorded round 1, its verification read from its record."""
    monkeypatch.setattr(
        speed,
        "measure_round",
        lambda v, folder, settings, ranks=None: replayed(v, search.recorded / "verification.json", settings.confidence),
    )
    candidates = [
        Switch.of(row["switch"])
        for row in search.spec["rows"]
        if row["stage"] == "round 1" and row["switch"] in speed.TECHNIQUES
    ]
    picked, _ = search.run(candidates)
    return search, picked


def outcome(name: str, tmp_path: Path, monkeypatch) -> tuple[dict, Replay]:
    """The replayed search's outcome, ``{"pick": [switch, ...]}`` or ``{"diverges": "<stage>"}``, and the search."""
    search = Replay(RECORDED / name, tmp_path)
    try:
        _, picked = replay(search, monkeypatch)
    except Diverged as e:
        return {"diverges": str(e).split(":")[0]}, search
    return {"pick": [s.name for s in picked]}, search


@pytest.mark.parametrize("name", SETS)
def test_the_rules_replayed_on_a_recorded_search_reach_its_recorded_outcome(name, tmp_path, monkeypatch):
    """Today's rules, fed the recorded measurements, reach the outcome the set's ``replay.json`` names: the pick, or
    the stage where they ask for what the recorded search did not measure (a rule changed since it ran; its ``why``
    says which). Every round replayed reads the verdicts the recorded search printed."""
    expected = json.loads((RECORDED / name / "replay.json").read_text())
    got, search = outcome(name, tmp_path, monkeypatch)
    assert got == {k: v for k, v in expected.items() if k != "why"}
    recorded = {
        (r["stage"], r["switch"]): r["verdict"]
        for r in search.spec["rows"]
        if r["stage"] != "guard" and not r["switch"].startswith("+experiment")
    }  # +experiment=fast: composed from a command line
    stages = {r["stage"] for r in search.rows if r["stage"] != "guard"}
    assert {k: v for k, v in recorded.items() if k[0] in stages} == {
        (r["stage"], r["switch"]): r["verdict"] for r in search.rows if r["stage"] != "guard"
    }


def test_a_rule_changed_to_fit_one_run_fails_the_replay(tmp_path, monkeypatch):
    """The replay can fail: with ``tune.min_speedup`` raised above a recorded pick's low end, the verification keeps
    nothing (no change) where the set's outcome is that pick."""
    name = next((n for n in SETS if json.loads((RECORDED / n / "replay.json").read_text()).get("pick")), None)
    if name is None:
        pytest.skip("no recorded set replays to a pick")
    low = json.loads((RECORDED / name / "speed.json").read_text())["recommended"]["ci_low"]
    original = speed._Search.__init__

    def stricter(self, cfg, env, out):
        original(self, cfg, env, out)
        self.t = OmegaConf.merge(self.t, {"min_speedup": low + 0.01})

    monkeypatch.setattr(speed._Search, "__init__", stricter)
    assert outcome(name, tmp_path, monkeypatch)[0] == {"pick": []}
