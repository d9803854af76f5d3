"""Evaluation from the tensors against the per-sample DataLoader, interleaved: MNIST's 10,000 test images at batch
32 on one thread, each round the DataLoader (A), the tensors (B), the DataLoader again (A/A); writes
docs/benchmarks/eval-loading-cpu-<date>.md.

    python scripts/bench_eval_loading.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from runner import data as data_mod, distributed
from runner.data.batches import DeviceIterable
from runner.engine import evaluation
from runner.engine.build import build_parts
from runner.techniques import variants

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    cfg = variants.compose(["dataloader.batch_size=32", "logger=none"])
    parts, _ = build_parts(cfg, distributed.setup(cfg.distributed, "cpu"), Path("/tmp/bench-eval-loading"))
    per_sample = DataLoader(data_mod.source_for(cfg.data).eval, batch_size=32)
    ways = {
        "A": DeviceIterable(per_sample, torch.device("cpu"), False, torch.contiguous_format),
        "B": parts.data.eval,
    }
    seconds: dict[str, list[float]] = {"A": [], "B": [], "A2": []}
    for _ in range(args.rounds):
        for name in ("A", "B", "A2"):
            parts.data.eval = ways[name[0]]
            started = time.perf_counter()
            evaluation._evaluate_once(parts)
            seconds[name].append(time.perf_counter() - started)
    ratio = [b / a for a, b in zip(seconds["A"], seconds["B"])]
    aa = [b / a for a, b in zip(seconds["A"], seconds["A2"])]
    day = time.strftime("%Y-%m-%d")
    lines = [
        f"# Evaluating from the tensors ({day})",
        "",
        f"Machine: {os.cpu_count()} cores, one intra-op thread, load {load:.2f} before it, nothing else running. "
        "Command: `python scripts/bench_eval_loading.py`. MNIST's 10,000 test images, batch 32, the default CNN; "
        f"{args.rounds} rounds, each: the per-sample DataLoader (A), the tensors (B, runner's evaluation), A again.",
        "",
        "| | median s | rounds |",
        "|---|---:|---|",
        *(f"| {k} | {statistics.median(v):.2f} | {', '.join(f'{x:.2f}' for x in v)} |" for k, v in seconds.items()),
        "",
        f"B ÷ A: median ×{statistics.median(ratio):.3f} (rounds {min(ratio):.3f}–{max(ratio):.3f}); "
        f"A/A: median ×{statistics.median(aa):.3f} (rounds {min(aa):.3f}–{max(aa):.3f}).",
        "",
    ]
    out = REPO / "docs" / "benchmarks" / f"eval-loading-cpu-{day}.md"
    out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
