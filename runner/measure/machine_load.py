"""How busy the machine was while the figures were taken (``LoadWindow``, opened by ``runner.measure``'s ``Meter``
over the measured steps), and when that makes them untrustworthy (``load_warnings``, which the speed doctor reads
first).
"""

from __future__ import annotations

import resource
import time
from typing import Any

import torch

from runner.measure import hardware

#: Others' load average may exceed the cores runner leaves free by half a core before it is called busy:
#: shells, editors and short jobs keep an idle machine's 1-minute load around 0.1-0.5.
LOAD_MARGIN = 0.5
#: More than 5 % of the CPUs' time given by the hypervisor to other VMs: a neighbour's load, which varies.
STEAL_FRACTION_MAX = 0.05
#: runner's threads waited for a CPU more than 10 % of the time they could have run: on a quiet machine
#: with no more threads than cores this stays at a few %; two busy processes on two cores make it ~50 %.
RUN_QUEUE_WAIT_MAX = 0.10
#: On a CPU the training thread keeps one core busy while it computes (Python, op dispatch, kernels):
#: fewer than 0.7 CPU-seconds per second of compute means it was often off the CPU, i.e. preempted.
BUSY_CORES_MIN = 0.7
#: Seconds between load-average samples: the kernel updates it every 5 s (LOAD_FREQ).
LOAD_SAMPLE_S = 5.0


class LoadWindow:
    """How busy the machine was while the measured steps ran: a window opened by ``start``, paused and
    resumed around evaluation and checkpoint writes, sampled at log steps (at most every ``LOAD_SAMPLE_S``).

    At each edge it reads the wall clock, this process's CPU time (``time.process_time``: every thread,
    user + system), its threads' run-queue wait and its live children's CPU time (``/proc``), the CPUs'
    steal ticks (``/proc/stat``) and the 1-minute load average; on CUDA, NVML's view of the GPU (other
    processes, clock throttling) at the start and end. A few reads of ``/proc`` per edge, nothing per step.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.running = False
        self.wall_s = self.cpu_s = self.children_cpu_s = 0.0
        self.on_cpu_ns = self.wait_ns = self.steal = self.ticks = self.minor_faults = 0
        self.sched_known = self.ticks_known = self.children_known = True
        self.load_start: float | None = None
        self.load_end: float | None = None
        self.load_max: float | None = None
        self.gpu_start: dict | None = None
        self.gpu_end: dict | None = None
        self._last_sample = 0.0

    def _snapshot(self) -> tuple:
        return (
            time.perf_counter(),
            time.process_time(),
            hardware.thread_schedule_ns(),
            hardware.cpu_ticks(),
            hardware.children_cpu_s(),
            resource.getrusage(resource.RUSAGE_SELF).ru_minflt,
        )

    def _note_load(self) -> float | None:
        load = hardware.load_average()
        if load is not None:
            self.load_max = load if self.load_max is None else max(self.load_max, load)
        self._last_sample = time.perf_counter()
        return load

    def start(self) -> None:
        """Open the window (the first measured step)."""
        self.load_start = self._note_load()
        self.gpu_start = hardware.gpu_contention(self.device)
        self.resume()

    def resume(self) -> None:
        if not self.running:
            self._edge = self._snapshot()
            self.running = True

    def pause(self) -> None:
        if not self.running:
            return
        (w0, c0, s0, t0, k0, f0), (w1, c1, s1, t1, k1, f1) = self._edge, self._snapshot()
        self.running = False
        self.wall_s += w1 - w0
        self.minor_faults += f1 - f0
        self.cpu_s += c1 - c0
        if s0 is None or s1 is None:
            self.sched_known = False
        else:  # threads that ended in between take their counts with them: never below zero
            self.on_cpu_ns += max(0, s1[0] - s0[0])
            self.wait_ns += max(0, s1[1] - s0[1])
        if t0 is None or t1 is None:
            self.ticks_known = False
        else:
            self.steal, self.ticks = self.steal + t1[0] - t0[0], self.ticks + t1[1] - t0[1]
        if k0 is None or k1 is None:
            self.children_known = False
        else:  # workers that exited in between are lost; workers started in between count whole
            self.children_cpu_s += max(0.0, k1 - k0)
        self.load_end = self._note_load()
        self.gpu_end = hardware.gpu_contention(self.device) if self.gpu_start is not None else None

    def sample(self) -> None:
        """At a log step: note the load average, at most every ``LOAD_SAMPLE_S``."""
        if self.running and time.perf_counter() - self._last_sample >= LOAD_SAMPLE_S:
            self._note_load()

    def record(self, threads: int, workers: int, data_wait_s: float, steps: int) -> dict[str, Any]:
        """The window's figures (summary.json ``machine_load``: each key and its formula in docs/outputs-and-loggers.md,
        "summary.json"); ``threads`` = ``torch.get_num_threads()``, ``workers`` = DataLoader worker processes,
        ``data_wait_s`` = measured data wait inside the window, ``steps`` = the measured steps in it. Fractions are
        None where the OS does not report them.
        """
        window = self.wall_s
        own_cores = (self.cpu_s + (self.children_cpu_s if self.children_known else 0.0)) / window if window > 0 else 0.0
        sched_total = self.on_cpu_ns + self.wait_ns
        gpu = None
        if self.gpu_start is not None or self.gpu_end is not None:
            ends = [g for g in (self.gpu_start, self.gpu_end) if g]
            gpu = {
                "other_processes": max(g["other_processes"] for g in ends),
                "sweep_processes": max(g.get("sweep_processes", 0) for g in ends),  # paused jobs: no warning
                "throttle_reasons": sorted({r for g in ends for r in g["throttle_reasons"]}),
                "utilization_percent_end": (self.gpu_end or {}).get("utilization_percent"),
            }
        return {
            "window_s": window,
            "cpu_cores": hardware.cpu_cores(),
            "threads": threads,
            "workers": workers,
            "load_average_1min_start": self.load_start,
            "load_average_1min_end": self.load_end,
            "load_average_1min_max": self.load_max,
            "load_average_others": (
                round(max(0.0, self.load_max - own_cores), 2) if self.load_max is not None else None
            ),
            "cpu_time_s": self.cpu_s,
            "workers_cpu_time_s": self.children_cpu_s if self.children_known and workers else None,
            "cpu_util_fraction": self.cpu_s / (window * threads) if window > 0 and threads else None,
            "busy_cores_computing": (self.cpu_s / (window - data_wait_s) if window - data_wait_s > 1e-3 else None),
            "run_queue_wait_fraction": (self.wait_ns / sched_total if self.sched_known and sched_total > 0 else None),
            "steal_fraction": self.steal / self.ticks if self.ticks_known and self.ticks > 0 else None,
            "gpu": gpu,
            "minor_page_faults_per_step": self.minor_faults / steps if steps else None,
        }


def load_warnings(load: dict[str, Any] | None, device_type: str) -> list[str]:
    """Why the figures of a run with this ``machine_load`` record cannot be trusted: one sentence per reason,
    empty when none applies. The reasons: docs/outputs-and-loggers.md, summary.json ``warnings``; their thresholds
    are this module's constants (each says why). On a CPU where runner's threads outnumber the cores left free, the
    first busy-machine or run-queue sentence also names ``trainer.num_threads=<n>`` (``threads_that_fit``).
    """
    if not load:
        return []
    out = []
    cores, threads, workers = load["cpu_cores"], load["threads"], load["workers"]
    own = f"{threads} thread{'s' if threads != 1 else ''}" + (f" + {workers} DataLoader workers" if workers else "")
    free = max(0, cores - threads - workers)
    others = load.get("load_average_others")
    if others is not None and others > free + LOAD_MARGIN:
        out.append(
            f"the machine was busy: load average up to {load['load_average_1min_max']} on {cores} cores, "
            f"about {others:.1f} of it other processes, while runner used {own} ({free} core(s) left "
            f"free)"
        )
    steal = load.get("steal_fraction")
    if steal is not None and steal > STEAL_FRACTION_MAX:
        out.append(
            f"the hypervisor took {steal:.0%} of the CPUs' time for other VMs (steal > {STEAL_FRACTION_MAX:.0%})"
        )
    wait = load.get("run_queue_wait_fraction")
    if wait is not None and wait > RUN_QUEUE_WAIT_MAX:
        cause = (
            f"runner's own {own} outnumber the {cores} cores"
            if threads + workers > cores
            else "other processes competed for the cores"
        )
        out.append(
            f"runner's threads waited for a CPU {wait:.0%} of the time they could run (> "
            f"{RUN_QUEUE_WAIT_MAX:.0%}): {cause}"
        )
    busy = load.get("busy_cores_computing")
    if device_type == "cpu" and busy is not None and busy < BUSY_CORES_MIN:
        out.append(
            f"runner's {threads} thread(s) used only {busy:.2f} CPU-s per second of compute (< "
            f"{BUSY_CORES_MIN}): the training thread was often off the CPU"
        )
    fit = threads_that_fit(load) if device_type == "cpu" else None
    crowded = [i for i, line in enumerate(out) if line.startswith(("the machine was busy", "runner's threads waited"))]
    if fit is not None and crowded:
        out[crowded[0]] += (
            f"; trainer.num_threads={fit} runs runner's threads on the {fit} free core(s) instead of fighting for them"
        )
    gpu = load.get("gpu") or {}
    if gpu.get("other_processes"):
        out.append(f"{gpu['other_processes']} other process(es) ran on the GPU")
    if gpu.get("throttle_reasons"):
        out.append(f"the GPU's clocks were throttled ({', '.join(gpu['throttle_reasons'])})")
    return out


def threads_that_fit(load: dict[str, Any] | None) -> int | None:
    """The intra-op thread count (``trainer.num_threads``) that fits the cores the machine had free for runner
    while it measured: its cores less the DataLoader workers and the other processes' load (rounded), at least 1.
    None when runner's threads fit already, or the record cannot tell (no cores or threads in it)."""
    if not load or not load.get("cpu_cores") or not load.get("threads"):
        return None
    others = load.get("load_average_others") or 0.0
    fit = max(1, int(load["cpu_cores"]) - int(load.get("workers") or 0) - round(others))
    return fit if fit < load["threads"] else None
