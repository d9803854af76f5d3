"""Time to target as a comparison metric: samples to target over seeds (runner/compare/convergence.py), its
combination with the interleaved throughput ratio, and the engine's ``steps_to_target`` / ``samples_to_target``.

The statistics run on synthetic seeds (milliseconds): log-normal samples to target with a 6 % spread per seed, dated
on a grid of evaluations where ties matter; one tiny real run checks the summary's figures and their reader.
"""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest

from conftest import compose_cfg
from runner import compare
from runner.compare import convergence as cv, stats
from runner.engine.state import SharedState, TrainState
from runner.engine.train import train

ALPHA = 0.05


def seeds(
    rng: random.Random, n: int, scale: float = 1.0, spread: float = 0.06, limit: float | None = None, grid: int = 1
) -> list[cv.Seed]:
    """``n`` seeds needing ``scale`` × 10,000 samples (log-normal, ``spread``), dated at the first multiple of
    ``grid`` samples (an evaluation) at or past it, censored at ``limit`` (the common step limit, in samples)."""
    out = []
    for i in range(n):
        need = grid * math.ceil(10_000 * scale * math.exp(rng.gauss(0, spread)) / grid)
        out.append(cv.Seed(need, True, i) if limit is None or need <= limit else cv.Seed(limit, False, i))
    return out


def test_the_null_distribution_is_the_mann_whitney_count():
    m, n = 4, 3  # every way to interleave 4 and 3 values, counting the pairs in which the first is larger
    counts = [0] * (m * n + 1)
    for positions in itertools.combinations(range(m + n), m):
        counts[sum(sum(1 for q in range(m + n) if q < p and q not in positions) for p in positions)] += 1
    cdf = list(itertools.accumulate(c / math.comb(m + n, m) for c in counts))
    assert cv.null_cdf(m, n) == pytest.approx(cdf)
    assert cv.null_cdf(3, 3)[0] == pytest.approx(1 / 20) and cv.null_cdf(8, 8)[-1] == 1.0
    big = cv.null_cdf(20, 20)
    assert big[200] == pytest.approx(0.5 + 0.5 * (big[200] - big[199]))  # symmetric about m n / 2


def test_a_real_20_percent_difference_is_found():
    rng = random.Random(0)
    faster = cv.samples_to_target(seeds(rng, 8, 0.8), seeds(rng, 8))
    assert faster.high < 1 and faster.p_value < ALPHA and 0.72 < faster.estimate < 0.88
    assert stats.verdicts([faster]) == [stats.HELPS]
    slower = cv.samples_to_target(seeds(rng, 8, 1.25, grid=200), seeds(rng, 8, grid=200))  # evaluations every 200
    assert slower.low > 1 and 1.12 < slower.estimate < 1.4 and stats.verdicts([slower]) == [stats.HURTS]
    assert slower.counts == "8/8 vs 8/8" and slower.n == 16 and slower.quantity == "samples"


@pytest.mark.parametrize(
    "grid, limit",
    [(1, None), (400, None), (1, 10_500)],
    ids=["continuous", "evaluation-grid-ties", "censored-at-a-common-limit"],
)
def test_an_aa_is_not_called(grid, limit):
    rng = random.Random(grid + (limit or 0))
    called, draws = 0, 200
    for _ in range(draws):
        r = cv.samples_to_target(seeds(rng, 8, grid=grid, limit=limit), seeds(rng, 8, grid=grid, limit=limit))
        assert (r.p_value <= ALPHA) == (r.low > 1 or r.high < 1)  # the p-value is the interval's inversion
        called += r.p_value <= ALPHA
    assert called / draws <= 0.08  # nominal 5 %; ties and censored pairs only make it rarer


def test_censored_seeds_are_counted_not_dropped():
    rng = random.Random(3)
    reference = seeds(rng, 8)
    config = seeds(rng, 8, 1.1)
    limit = max(s.value for s in config + reference)
    censored = [cv.Seed(limit, False, s.seed) if i < 3 else s for i, s in enumerate(config)]  # 3 never got there
    r = cv.samples_to_target(censored, reference)
    assert r.counts == "5/8 vs 8/8" and r.seeds == 8
    dropped = cv.samples_to_target(censored[3:], reference)
    assert r.estimate > cv.samples_to_target(config, reference).estimate  # later than every seed that got there
    assert r.estimate > dropped.estimate and r.p_value < dropped.p_value  # dropping them would flatter the config
    assert math.isinf(r.high) and r.low > 1 and stats.verdicts([r]) == [stats.HURTS]
    never = cv.samples_to_target([cv.Seed(limit, False, i) for i in range(8)], reference)
    assert never.counts == "0/8 vs 8/8" and never.estimate == math.inf and never.low > 1  # at least limit / slowest
    helped = cv.samples_to_target(reference, censored)  # the other way round: the reference's seeds censored
    assert helped.high < 1 and helped.low == 0 and stats.verdicts([helped]) == [stats.HELPS]


def test_too_few_seeds_give_no_interval():
    rng = random.Random(4)
    assert cv.samples_to_target(seeds(rng, 2, 0.5), seeds(rng, 8)) is None
    assert cv.samples_to_target([cv.Seed(1e4, False)] * 8, [cv.Seed(1e4, False)] * 8) is None  # none reached
    assert stats.verdicts([None]) == [""]
    three = cv.samples_to_target(seeds(rng, 3, 0.5), seeds(rng, 3))  # fully separated, and still no verdict
    assert (three.low, three.high) == (0.0, math.inf) and three.p_value == pytest.approx(0.1)
    assert stats.verdicts([three]) == [stats.NO_EFFECT]
    with pytest.raises(ValueError, match="different targets"):
        cv.samples_to_target([cv.Seed(1, True, target="eval_loss <= 1")] * 3, [cv.Seed(1, True, target="x")] * 3)


def test_time_to_target_divides_by_the_throughput_ratio():
    rng = random.Random(5)
    config, reference = seeds(rng, 8, 0.8), seeds(rng, 8)
    samples = cv.samples_to_target(config, reference)
    same_cost = cv.time_to_target(config, reference)  # a technique that does not change a step's cost
    assert same_cost.quantity == "time" and (same_cost.estimate, same_cost.low, same_cost.high, same_cost.p_value) == (
        samples.estimate,
        samples.low,
        samples.high,
        samples.p_value,
    )
    throughput = stats.paired([math.log(0.9) + rng.gauss(0, 0.03) for _ in range(8)])  # 10 % slower steps
    time = cv.time_to_target(config, reference, throughput)
    assert time.estimate == pytest.approx(samples.estimate / throughput.estimate)
    both = cv.time_to_target(config, reference, throughput, confidence=0.975)
    halves = cv.samples_to_target(config, reference, 0.975), stats.at_confidence(throughput, 0.975)
    assert time.low == pytest.approx(halves[0].low / halves[1].high)  # Bonferroni: each factor at 1 - α/2
    assert time.high == pytest.approx(halves[0].high / halves[1].low) and both.low < time.low
    assert time.low < samples.low / throughput.high  # wider than the two 95 % intervals divided
    assert (time.p_value <= ALPHA) == (time.high < 1 or time.low > 1)
    assert cv.time_to_target(config, reference, None) is None  # the interleaved comparison had no interval
    covered = 0
    for _ in range(100):  # true time ratio 0.8 / 0.9
        thr = stats.paired([math.log(0.9) + rng.gauss(0, 0.03) for _ in range(6)])
        r = cv.time_to_target(seeds(rng, 8, 0.8), seeds(rng, 8), thr)
        covered += r.low <= 0.8 / 0.9 <= r.high
    assert covered >= 95


def test_one_holm_family_holds_throughput_and_target_ratios():
    rng = random.Random(6)
    big = cv.samples_to_target(seeds(rng, 8, 0.7), seeds(rng, 8))
    aa = cv.samples_to_target(seeds(rng, 8), seeds(rng, 8))
    faster_steps = stats.paired([math.log(1.3) + rng.gauss(0, 0.02) for _ in range(6)])
    found = [
        r
        for r in (
            cv.samples_to_target(seeds(random.Random(s), 5, 0.85), seeds(random.Random(s + 99), 5)) for s in range(200)
        )
        if 0.01 < r.p_value <= ALPHA
    ]
    weak = found[0]  # called alone, not among four
    assert stats.verdicts([weak]) == [stats.HELPS]
    assert stats.verdicts([big, aa, faster_steps, weak, None]) == [
        stats.HELPS,
        stats.NO_EFFECT,
        stats.HELPS,
        stats.NO_EFFECT,
        "",
    ]


def test_samples_to_target_survives_a_checkpoint():
    state = TrainState(time_to_target_s=1.5, steps_to_target=6, samples_to_target=96)
    restored = TrainState()
    SharedState(restored).load_state_dict(SharedState(state).state_dict())
    assert (restored.steps_to_target, restored.samples_to_target) == (6, 96)
    old = SharedState(state).state_dict()  # a checkpoint written before runner recorded them
    fields = json.loads(old["fields"])
    del fields["steps_to_target"], fields["samples_to_target"]
    SharedState(restored).load_state_dict({"fields": json.dumps(fields)})
    assert restored.samples_to_target is None and restored.time_to_target_s == 1.5


def test_summary_records_the_samples_at_the_target_and_the_reader_reads_them(tmp_path):
    reached = train(
        compose_cfg(
            "trainer.eval_every=2", "trainer.target_loss=1000", "trainer.stop_at_target=true", "trainer.seed=3"
        ),
        job_dir=tmp_path / "reached",
    )
    assert reached["steps_to_target"] == 2 and reached["steps"] == 2  # the first evaluation meets it, and stops
    assert reached["samples_to_target"] == reached["steps_to_target"] * reached["global_batch_size"] == 32
    missed = train(compose_cfg("trainer.eval_every=3", "trainer.target_loss=1e-9"), job_dir=tmp_path / "missed")
    assert missed["time_to_target_s"] is None
    assert missed["steps_to_target"] is None and missed["samples_to_target"] is None and missed["steps"] == 4
    assert compare.read_seeds([tmp_path / "reached", tmp_path / "missed"]) == [
        cv.Seed(32, True, 3, "eval_loss <= 1000", str(tmp_path / "reached" / "summary.json")),
        cv.Seed(64, False, 0, "eval_loss <= 1e-09", str(tmp_path / "missed" / "summary.json")),
    ]  # 4 steps x 16


def write_summary(folder, **fields):
    folder.mkdir(parents=True)
    summary = {
        "time_to_target_s": 1.0,
        "samples_to_target": 640,
        "steps": 40,
        "global_batch_size": 16,
        "config": {"trainer": {"seed": 0, "target_accuracy": 0.9, "target_loss": None}},
    } | fields
    (folder / "summary.json").write_text(json.dumps(summary))
    return folder


def test_the_reader_names_the_summary_that_lacks_the_figures(tmp_path):
    untargeted = write_summary(
        tmp_path / "untargeted",
        time_to_target_s=None,
        samples_to_target=None,
        config={"trainer": {"seed": 0, "target_accuracy": None, "target_loss": None}},
    )
    with pytest.raises(ValueError, match=f"{untargeted / 'summary.json'}: the run had no target"):
        cv.read_seed(untargeted)
    old = write_summary(tmp_path / "old", samples_to_target=None) / "summary.json"
    with pytest.raises(ValueError, match=f"{old}: the target was reached .* samples_to_target is null"):
        cv.read_seed(old.parent)
    older = tmp_path / "older"
    write_summary(older)
    summary = json.loads((older / "summary.json").read_text())
    del summary["samples_to_target"]
    (older / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(ValueError, match=f"{older / 'summary.json'}: no samples_to_target"):
        cv.read_seed(older)
    with pytest.raises(FileNotFoundError, match="never reached the target"):
        cv.read_seed(tmp_path / "diverged")
    twice = [write_summary(tmp_path / "a"), write_summary(tmp_path / "b")]
    with pytest.raises(ValueError, match=r"seed\(s\) \[0\] appear more than once"):
        cv.read_seeds(twice)
