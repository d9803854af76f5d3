"""Is some of this machine's memory slower than the rest, consistently? (issue 17: why identical processes differ)

    python scripts/memory_placement.py --buffers 48 --mb 256 --rounds 12

Allocates ``--buffers`` fp32 buffers of ``--mb`` MiB each (one after another, so they land on different physical
pages), then copies each into one destination buffer ``--rounds`` times, every round in a fresh random order, on
one thread. It prints each buffer's median copy bandwidth in the first and the second half of the rounds, relative
to the median of all, and the correlation between the halves: a buffer that is slow in both halves (correlation
near 1) is slow because of where it lives, not because of when it was measured. On a VM, guest-physical pages can
be backed by host memory at different distances from the vCPUs (another NUMA node of the host), which would make a
process whose working set landed there slower for its whole life: the process-level bias of docs/ablation.md.
Measure alone on the machine.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--buffers", type=int, default=48)
    ap.add_argument("--mb", type=int, default=256, help="MiB per buffer")
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args()
    torch.set_num_threads(1)
    bufs = [torch.ones(args.mb * 2**20 // 4) for _ in range(args.buffers)]
    dst = torch.empty_like(bufs[0])
    seconds: list[list[float]] = [[] for _ in bufs]
    for _ in range(args.rounds):
        order = list(range(len(bufs)))
        random.shuffle(order)
        for i in order:
            start = time.perf_counter()
            dst.copy_(bufs[i])
            seconds[i].append(time.perf_counter() - start)
    gib_s = [[2 * args.mb / 1024 / s for s in ss] for ss in seconds]  # read + write
    half = args.rounds // 2
    first = [statistics.median(g[:half]) for g in gib_s]
    second = [statistics.median(g[half:]) for g in gib_s]
    mid = statistics.median(first + second)
    for i, (a, b) in enumerate(zip(first, second)):
        print(f"buffer {i:3d}: {a / mid:.3f} {b / mid:.3f}")
    rel = [(a + b) / 2 / mid for a, b in zip(first, second)]
    print(f"median {mid:.1f} GiB/s; buffers span x{min(rel):.3f} to x{max(rel):.3f}; "
          f"correlation between the halves {statistics.correlation(first, second):.2f}")


if __name__ == "__main__":
    main()
