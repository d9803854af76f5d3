"""The recipe search's verification on fresh seeds (runner/sweeps/search_verify.py), over simulated and fake runs: the
looks' shared error rate, the false-verdict rate it keeps, the stop at the first firm look and the best few side by
side. Nothing here asks Optuna anything (CI's run under the oldest Optuna takes tests/test_search.py alone).
"""

from __future__ import annotations

import math

import pytest


def test_the_looks_share_the_error_rate():
    from runner.sweeps import search_verify as verify

    assert verify.look_confidence(8, 1, 0.95) == pytest.approx(1 - 0.05 / 6)  # looks at 3, 4, ..., 8 seeds a side
    assert verify.look_confidence(6, 2, 0.95) == pytest.approx(1 - 0.05 / 8)  # 4 looks, 2 candidates
    assert verify.look_confidence(3, 1, 0.95) == pytest.approx(0.95)


def _false_verdicts(level: float, seeds: int = 8, searches: int = 2000, censored: float = 0.0) -> float:
    """The share of ``searches`` in which two sides with one log-normal distribution got a firm time verdict at
    some look from the 3rd seed (a run missing the target with probability ``censored``)."""
    import random

    from runner.compare.convergence import Seed
    from runner.sweeps.search_verify import firm, time_ratio

    rng, false = random.Random(7), 0
    for _ in range(searches):
        a, b = ([Seed(rng.lognormvariate(3, 0.3), rng.random() >= censored) for _ in range(seeds)] for _ in range(2))
        false += any(firm(time_ratio(a[:k], b[:k], level)) for k in range(3, seeds + 1))
    return false / searches


def test_the_sequential_looks_keep_false_verdicts_within_the_stated_rate():
    """Two recipes alike, 2,000 simulated verifications of 8 seeds: looking after each seed from the 3rd at the
    Bonferroni level gives a false verdict in at most 5 % of them (+ Monte Carlo error), by Welch's t where every run
    reached the target and by the rank test where some did not; looking at 95 % each time gives more."""
    from runner.sweeps import search_verify as verify

    level, bound = verify.look_confidence(8, 1, 0.95), 0.05 + 3 * (0.05 * 0.95 / 2000) ** 0.5
    sequential, censored = _false_verdicts(level), _false_verdicts(level, censored=0.2)
    naive = _false_verdicts(0.95)
    assert sequential <= bound and censored <= bound, (sequential, censored)
    assert naive > sequential + 0.02, (naive, sequential)


def _verification(monkeypatch, best: list[float], start: list[float], seeds: int = 8):
    """``verify.verify`` of one candidate over fake runs that reached the target after ``best[i]`` and ``start[i]``
    samples (and as many seconds / 100); the lines, the record and the runs it asked for."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from runner.compare.convergence import Seed
    from runner.sweeps import search_verify as verify

    asked = []

    def runs(sweeper, sides, seed_list):
        for i in range(len(sides) * len(seed_list)):
            asked.append(i)
            n = (best if i % 2 == 0 else start)[i // 2]
            yield i, verify.Run(Seed(n, True), Seed(n / 100, True))

    monkeypatch.setattr(verify, "runs", runs)
    cfg = OmegaConf.create(
        {
            "trainer": {"target_accuracy": 0.9, "target_loss": None, "seed": 0},
            "hydra": {"sweep": {"dir": "/nonexistent"}},
        }
    )
    sweeper = SimpleNamespace(config=cfg, confidence=0.95)
    trial = SimpleNamespace(number=3, params={"optimizer.lr": 0.02}, value=1.0)
    plan = {"seeds": list(range(100, 100 + seeds)), "fixed": ["trainer.seed=0"]}
    lines, record, found = verify.verify(sweeper, plan, [trial])
    return lines, record, asked


def test_the_best_few_are_verified_side_by_side_and_the_fastest_on_fresh_seeds_is_the_recipe(monkeypatch):
    """``verify_candidates=2``: each seed runs both candidates and the start; the second-best trial of the search,
    the faster one on fresh seeds, is the recipe found, and the record keeps both."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from runner.compare.convergence import Seed
    from runner.sweeps import search_verify as verify

    samples = {0: 2000.0, 1: 1000.0, 2: 3000.0}  # best, best2, start

    def runs(sweeper, sides, seed_list):
        assert [s.name for s in sides] == ["best", "best2", "start"]
        for i in range(len(sides) * len(seed_list)):
            yield i, verify.Run(Seed(samples[i % 3] + i, True), Seed((samples[i % 3] + i) / 100, True))

    monkeypatch.setattr(verify, "runs", runs)
    cfg = OmegaConf.create(
        {
            "trainer": {"target_accuracy": 0.9, "target_loss": None, "seed": 0},
            "hydra": {"sweep": {"dir": "/nonexistent"}},
        }
    )
    sweeper = SimpleNamespace(config=cfg, confidence=0.95)
    trials = [
        SimpleNamespace(number=n, params={"optimizer.lr": lr}, value=v) for n, lr, v in ((3, 0.02, 1.0), (5, 0.03, 1.1))
    ]
    lines, record, found = verify.verify(sweeper, {"seeds": list(range(100, 108)), "fixed": []}, trials)
    assert found is trials[1], lines
    assert record["stopped"] == "firm at seed 3 of 8"  # Welch's t: every run reached the target
    assert set(record["candidates"]) == {"best", "best2"} and record["candidates"]["best2"]["params"] == {
        "optimizer.lr": 0.03
    }
    assert any(line.startswith("the recipe found is best2 (candidate (trial 6))") for line in lines), lines


def test_the_verification_stops_at_the_first_firm_look(monkeypatch):
    lines, record, asked = _verification(monkeypatch, [1000.0 + i for i in range(8)], [3000.0 + i for i in range(8)])
    assert len(asked) == 6 and record["seeds"] == [100, 101, 102], (asked, record)
    assert record["stopped"] == "firm at seed 3 of 8" and record["time_to_target"]["high"] < 1
    assert any(
        line.startswith("time to target, best / start (Welch's t on the logs): x0.334") and "at 99.17%" in line
        for line in lines
    ), lines
    assert record["samples_to_target"]["high"] == math.inf  # 3 a side: the rank test cannot be firm yet
    assert any(
        line.startswith("samples to target, best / start: x0.334 [0, inf]") and "too few seeds" in line
        for line in lines
    ), lines
    # interleaved values: no look is firm, every seed runs
    lines, record, asked = _verification(
        monkeypatch, [1000.0 + 2 * i for i in range(8)], [1001.0 + 2 * i for i in range(8)]
    )
    assert len(asked) == 16 and record["stopped"] == "all 8 seeds run", record
    assert any("no difference shown" in line for line in lines)


@pytest.mark.parametrize("seeds", [1, 2])
def test_fewer_seeds_than_a_first_look_needs_all_run_and_are_counted(monkeypatch, seeds):
    """``verify_seeds`` below the first look's 3 seeds a side: every seed runs and counts in the table, with no
    interval (the loop once broke after the first run: "firm at seed 0", nothing counted)."""
    lines, record, asked = _verification(monkeypatch, [1000.0, 1001.0], [3000.0, 3001.0], seeds=seeds)
    assert len(asked) == 2 * seeds and record["seeds"] == list(range(100, 100 + seeds)), (asked, record)
    assert record["stopped"] == f"all {seeds} seeds run", record
    assert any(line.startswith(f"| best trial (trial 4) | {seeds}/{seeds} |") for line in lines), lines
    assert any("no interval: fewer than 3 seeds a side" in line for line in lines), lines
