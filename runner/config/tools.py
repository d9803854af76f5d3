"""The settings of runner's tools, as structured-config schemas: ``ablation.*`` (runner/sweeps/ablation.py),
``interleave.*`` (runner/compare/: ``hydra/launcher=interleaved``) and ``tune.*`` (runner/tune/).

Training (``runner.engine.train``) never reads them; they are nodes of the primary config (``RunnerConfig``) so
that a misspelt or mistyped key fails at compose time like any other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class AblationConfig:
    """``+experiment=ablation`` (conf/experiment/ablation.yaml, conf/ablation/variant/; runner/sweeps/ablation.py)."""

    repeat: int = 0  # this job's process of its configuration, 0 .. interleave.processes-1 (folder <variant>/r<repeat>)
    variant: Optional[str] = None  # this job's configuration, e.g. baseline, baseline+amp, fast-amp
    kind: Optional[str] = None  # baseline | leave-one-in | fast | leave-one-out
    technique: Optional[str] = None  # the technique the variant switches on (leave-one-in) or off (leave-one-out)
    requires: Optional[str] = None  # cuda: the variant is not run (recorded as not run) on other devices
    # what the sweep measures: speed (samples/s, interleaved: +experiment=ablation) | convergence (samples to target
    # over seeds: +experiment=convergence, runner/report/convergence.py)
    measure: str = "speed"
    # convergence: each seed's budget and evaluation interval in samples, so every batch size gets the same ones
    # (trainer.max_steps and trainer.eval_every are derived from them: ${runner_steps:samples,batch})
    max_samples: Optional[int] = None
    eval_samples: Optional[int] = None


@dataclass
class InterleaveConfig:
    """``interleave.*``: the interleaved launcher (``python -m runner -m hydra/launcher=interleaved <sweep>``;
    runner/compare/). Every job of the sweep is resident in its own process; they take turns training for
    a slice while the others wait, and each job's samples/s is compared with its reference's in the adjacent
    slice (a paired ratio), pass after pass, until the intervals are tight or the time is spent."""

    reference: Optional[int] = None  # the sweep's reference job (its index in the sweep); null = the first job
    processes: int = 3  # processes per configuration: the process is the unit of replication (identical processes
    # can differ for their whole life: on a CPU VM up to 25 % with glibc's malloc as it comes, about 2 % with
    # trainer.host_allocator=reuse, the default); 1 = one each, intervals over passes
    slice_steps: Optional[int] = None  # optimizer steps per slice; null = about slice_seconds of the reference's
    slice_seconds: float = 4.0  # the length of a slice when slice_steps is null (calibrated on the reference)
    resume_steps: Optional[int] = None  # unmeasured steps before each slice (a job idle for a pass runs slower at
    # first: measured 20-50 % on this project's VM); null = a quarter of the slice
    target_ci: float = 0.03  # stop once every comparison's 95 % interval is within +-this (relative)
    min_passes: int = 4  # passes before the intervals may stop the sweep
    max_passes: int = 200  # at most this many passes
    max_minutes: float = 30.0  # the measuring time of the whole sweep (setup excluded); then it stops
    order: str = "rmit"  # rmit: each job once per pass, random order | abba: R J J R, reversed every other
    # pass | random
    seed: int = 0  # the order's random generator (random order, and the shuffle of jobs between references)
    memory_margin: float = 3.0  # admit another job only while free memory > this x the largest job's footprint:
    # the job itself, and room for the resident ones to grow (loader workers, allocator caches; at 1.5 a
    # 33-process resnet18/CIFAR ablation met the out-of-memory killer)
    max_resident: Optional[int] = None  # at most this many jobs resident at once (null: as memory allows)
    fallback_pairs: int = 4  # a job with no room beside its reference (or killed for memory there) is measured
    # after the groups in this many pairs of fresh processes (reference, job; ABBA): the rounds design
    confidence: float = 0.95  # of every interval; verdicts: Holm's step-down over the sweep at 1 - confidence


@dataclass
class TuneConfig:
    """``tune.*``: the settings of ``python -m runner.tune batch_size|lr|dataloader|speed`` (runner/tune/); training
    (``python -m runner``) never reads them. Values are checked by ``runner.tune.check_settings``."""

    # batch_size and dataloader: each configuration trains this many steps with the run's own engine
    warmup_steps: int = 2  # steps per configuration left out of every figure (allocator growth, workers starting)
    measure_steps: int = 10  # measured steps per configuration (more on a noisy machine)
    # batch_size: powers of two from start_batch_size, then a binary search (micro-batch per rank, samples)
    start_batch_size: int = 16
    max_batch_size: int = 4096
    max_memory_fraction: float = 0.9  # of the GPU's memory (of host RAM per process on a CPU) a size may use
    search_steps: int = 3  # binary-search steps between the last good and the first bad or slower size
    # lr: the LR range test (Smith 2017; fastai's lr_find): exponential ramp min_lr -> max_lr over steps
    min_lr: float = 1e-7
    max_lr: float = 10.0
    steps: int = 100
    smoothing: float = 0.98  # EMA factor of the loss (bias-corrected)
    diverge_factor: float = 4.0  # stop once the smoothed loss exceeds this x its best
    # dataloader: the grid num_workers x pin_memory x prefetch_factor; null = a default for this machine
    workers: Optional[list[int]] = None  # null: 0, 1, 2, 4, ... up to the CPU count
    pin_memory: Optional[list[bool]] = None  # null: [false, true] on CUDA, [false] on a CPU (pinning needs CUDA)
    prefetch_factors: Optional[list[int]] = None  # null: [2, 4] on CUDA, [2] on a CPU (only with workers > 0)
    loader_batches: int = 30  # batches timed on the loader alone, after warmup_steps batches
    tolerance: float = 0.05  # pick the fewest workers within this fraction of the best samples/s
    # speed: the combination of the speed switches, then backward elimination, measured interleaved (tune/speed.py)
    budget_minutes: float = 20.0  # measuring time of the whole search (a quarter kept for the verification); the guard,
    # start-up and compilation of each round's processes come on top
    allow: str = "speed"  # speed: switches that keep the recipe | recipe: also a 2x/4x micro-batch, LR scaled
    only: Optional[list[str]] = None  # try only these built-in switches (names as the report lists them)
    switches: dict[str, Any] = field(default_factory=dict)  # your own candidates: name -> {dotted.key: value}
    guard_steps: int = 50  # steps each candidate trains from your weights and batches before it is measured
    guard_tolerance: float = 0.02  # reject a candidate whose loss departs from yours (relative) more than this and
    # more than yours does under another seed (trainer.seed + 1)
    min_speedup: float = 1.0  # a switch is kept when its interval's low end is above this
    target_ci: float = 0.05  # a round stops once every interval is within +-this (or its time is spent)
    slice_seconds: float = 1.0  # each round's slices (interleave.slice_steps, when set, wins)
    # processes per configuration in each round; null: 1 on a CPU (resident processes compete for its few cores and
    # the reference's copy A' still measures the process effect), interleave.processes on a GPU
    processes: Optional[int] = None
    # job: rank by the whole job's projected wall time (one-time costs: compilation, autotuning) | throughput: samples/s
    objective: str = "job"
