"""runner's Shakespeare GPT beside nanoGPT's own ``train.py`` on this machine: whole wall time and validation loss.

    python scripts/bench_nanogpt.py --nanogpt ~/nanoGPT                      # recipe vs nanoGPT, 2 repeats each
    python scripts/bench_nanogpt.py --nanogpt ~/nanoGPT --tuned outputs/tune/speed/<date>_<time> --repeats 3
    python scripts/bench_nanogpt.py --nanogpt ~/nanoGPT --device cuda --target 1.47 --out gpu-race.md  # on a GPU

``--device cuda`` runs each program's GPU configuration instead: nanoGPT's ``config/train_shakespeare_char.py``
as it stands (6 x 384, block 256, batch 64, bf16, ``torch.compile``, evaluation every 250 steps on 200 random
batches of each split) and runner's ``+experiment=shakespeare_char_gpu compile=default`` (the same model,
data, optimizer and schedule; evaluation every 250 steps on the whole validation split, 7 batches). With
``--target LOSS`` each run is stopped at its first validation loss at or below ``LOSS`` and the figure is the
wall time from the process's start to the moment that loss was printed (start-up, compilation and
evaluations included, as a user waits for it), and the step. Every run compiles cold: it gets empty
TorchInductor and Triton caches of its own, so no program profits from a kernel another run compiled.

``--nanogpt``: a checkout of https://github.com/karpathy/nanoGPT whose character-level data is prepared
(``python data/shakespeare_char/prepare.py`` there; copy Tiny Shakespeare to ``data/shakespeare_char/input.txt``
first where there is no network). nanoGPT runs its README's CPU command, which is runner's
``+experiment=shakespeare_char`` (docs/benchmarks/gpt-cpu.md checked every setting); runner runs the recipe with
evaluation at nanoGPT's cost (``trainer.eval_max_batches=20``, as its ``--eval_iters=20``), and with ``--tuned DIR``
also the speed tuner's pick (``'+experiment=[shakespeare_char,tuned]' --config-dir DIR``).

The runs alternate (each repeat in a new random order), so drift on this shared machine falls on every
program alike; the table gives each program's median and range over the repeats. Wall time is the whole
process, start-up included, as a user waits for it; every process starts with empty TorchInductor and Triton
caches, as on a fresh node (the tuned run loads only the compile cache its preset carries, checked as yours).
Validation loss is each program's 20-batch estimate at step 2000 (nanoGPT: 20 random batches; runner: the first
20 windows of the split): its sampling error is about 0.015 (docs/benchmarks/gpt-cpu.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: nanoGPT's README, "I only have a macbook" (CPU), with the shakespeare_char config.
NANOGPT = [
    "train.py",
    "config/train_shakespeare_char.py",
    "--device=cpu",
    "--compile=False",
    "--eval_iters=20",
    "--log_interval=1",
    "--block_size=64",
    "--batch_size=12",
    "--n_layer=4",
    "--n_head=4",
    "--n_embd=128",
    "--max_iters=2000",
    "--lr_decay_iters=2000",
    "--dropout=0.0",
]
RUNNER = ["logger=none", "trainer.eval_max_batches=20", "task.sample_tokens=0", "trainer.doctor=false"]
#: the GPU configurations (``--device cuda``): nanoGPT's shakespeare_char config as it stands, runner's GPU recipe
NANOGPT_GPU = ["train.py", "config/train_shakespeare_char.py", "--log_interval=50"]
RUNNER_GPU = [
    "logger=none",
    "trainer.device=cuda",
    "trainer.progress=lines",
    "task.sample_tokens=0",
    "trainer.doctor=false",
]
#: ``--dry-run``: both programs on the CPU at toy sizes (1 x 32, block 32, batch 8, an evaluation every 20 steps)
DRY_NANOGPT = [
    "--device=cpu",
    "--compile=False",
    "--dtype=float32",
    "--n_layer=1",
    "--n_head=2",
    "--n_embd=32",
    "--block_size=32",
    "--batch_size=8",
    "--eval_iters=2",
    "--eval_interval=20",
    "--max_iters=60",
    "--warmup_iters=10",
    "--lr_decay_iters=60",
]
DRY_RUNNER = [
    "trainer.device=cpu",
    "compile=off",
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_embd=32",
    "data.block_size=32",
    "optimizer.base_batch_size=8",
    "trainer.eval_every=20",
    "trainer.max_steps=60",
    "trainer.eval_max_batches=2",
    "scheduler.warmup_steps=10",
]
NANOGPT_VAL = re.compile(r"step (\d+): train loss [\d.]+, val loss ([\d.]+)")


def raced(
    cmd: list[str], cwd: Path, target: float, limit_s: float, scratch: Path, runner_dir: Path | None = None
) -> dict:
    """Run ``cmd`` until its first validation loss at or below ``target`` (or its end, or ``limit_s``): the wall
    seconds from its start to that evaluation's line, its step, and every validation loss with its time.

    nanoGPT's losses are read from its ``step N: ... val loss X`` lines; runner's from ``metrics.jsonl`` in
    ``runner_dir`` (flushed before the console line, and unrounded). The process gets fresh, empty compile caches
    (``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR``) and is killed once the target is met."""
    import signal

    caches = Path(tempfile.mkdtemp(prefix="caches-", dir=scratch))
    env = os.environ | {
        "PYTHONUNBUFFERED": "1",
        "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
        "TRITON_CACHE_DIR": str(caches / "triton"),
    }
    started = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    evals: list[tuple[int, float, float]] = []  # (step, validation loss, seconds since start)
    seen_rows, tail = 0, []
    reached = None
    for line in proc.stdout:
        now = time.perf_counter() - started
        tail = (tail + [line])[-40:]
        if runner_dir is None:
            evals += [(int(m[1]), float(m[2]), now) for m in NANOGPT_VAL.finditer(line)]
        elif "eval_loss" in line and (runner_dir / "metrics.jsonl").is_file():
            rows = [json.loads(x) for x in (runner_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
            evals += [(r["step"], r["eval_loss"], now) for r in rows[seen_rows:] if r.get("eval_loss") is not None]
            seen_rows = len(rows)
        reached = next((e for e in evals if e[1] <= target), None)
        if reached or now > limit_s:
            break
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    if not evals:
        sys.exit(f"failed (no validation loss read): {' '.join(cmd)}\n{''.join(tail)}")
    return {
        "time_to_target_s": reached[2] if reached else None,
        "step": reached[0] if reached else None,
        "best_val_loss": min(e[1] for e in evals),
        "evals": evals,
        "wall_s": time.perf_counter() - started,
    }


def timed(cmd: list[str], cwd: Path, scratch: Path) -> tuple[float, str]:
    """``cmd``'s whole wall time and stdout, run as on a fresh node: empty TorchInductor and Triton caches of its own
    (runner compiles in a private folder anyway; a compiled run starts warm only from the cache its preset names)."""
    caches = Path(tempfile.mkdtemp(prefix="caches-", dir=scratch))
    env = os.environ | {"TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"), "TRITON_CACHE_DIR": str(caches / "triton")}
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return wall, proc.stdout


def run_nanogpt(root: Path, scratch: Path) -> dict:
    out = scratch / f"nanogpt-{time.time_ns()}"
    wall, stdout = timed([sys.executable, *NANOGPT, f"--out_dir={out}"], root, scratch)
    losses = re.findall(r"step (\d+): train loss [\d.]+, val loss ([\d.]+)", stdout)
    return {"wall_s": wall, "val_loss": float(losses[-1][1]) if losses else None}


#: The tuned preset's compile cache as the tuner wrote it (``keep_preset_cache``): (the folder, its copy)
PRESET_CACHE: list[tuple[Path, Path]] = []


def keep_preset_cache(tuned: Path, scratch: Path) -> None:
    """Copy the compile cache the tuned preset names (``compile.cache``), so that each tuned run starts from it as
    the tuner wrote it: a job adds its own entry to the folder, which a later run would load."""
    import shutil

    import yaml

    cache = (yaml.safe_load((tuned / "experiment" / "tuned.yaml").read_text()).get("compile") or {}).get("cache")
    if cache:
        shutil.copytree(cache, scratch / "preset-cache", symlinks=True)
        PRESET_CACHE.append((Path(cache), scratch / "preset-cache"))


def run_runner(experiment: str, config_dir: Path | None, scratch: Path, fresh_cache: bool = False) -> dict:
    if fresh_cache and PRESET_CACHE:  # the preset's compile cache exactly as the tuner wrote it
        import shutil

        ((cache, kept),) = PRESET_CACHE
        shutil.rmtree(cache)
        shutil.copytree(kept, cache, symlinks=True)
    folder = scratch / f"runner-{time.time_ns()}"
    search = ["--config-dir", str(config_dir.resolve())] if config_dir else []
    wall, _ = timed(
        [sys.executable, "-m", "runner", *search, f"+experiment={experiment}", *RUNNER, f"hydra.run.dir={folder}"],
        REPO,
        scratch,
    )
    summary = json.loads((folder / "summary.json").read_text())
    once = summary.get("one_time") or {}
    return {
        "wall_s": wall,
        "val_loss": summary.get("eval_loss"),
        "tokens_per_sec": summary.get("tokens_per_sec"),
        "compile_s": once.get("compile_s"),
        "compile_cache": once.get("compile_cache"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nanogpt", type=Path, required=True, help="a nanoGPT checkout with shakespeare_char prepared")
    p.add_argument("--tuned", type=Path, help="a runner.tune speed folder (holds experiment/tuned.yaml)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks" / "nanogpt-cpu.md")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: each program's GPU configuration")
    p.add_argument("--target", type=float, help="stop each run at its first validation loss <= this (--device cuda)")
    p.add_argument("--data", type=Path, help="Tiny Shakespeare's input.txt for runner (default: the recipe's)")
    p.add_argument("--limit-s", type=float, default=300.0, help="stop a run that has not met --target by then")
    p.add_argument("--dry-run", action="store_true", help="--device cuda's race on the CPU at toy sizes (CI)")
    args = p.parse_args()
    if args.device == "cuda":
        return race(args)
    if not (args.nanogpt / "data" / "shakespeare_char" / "train.bin").is_file():
        sys.exit(
            f"error: {args.nanogpt}/data/shakespeare_char/train.bin is missing: run "
            f"`python data/shakespeare_char/prepare.py` in {args.nanogpt} first"
        )
    programs = {
        "nanoGPT train.py": lambda s: run_nanogpt(args.nanogpt, s),
        "runner recipe": lambda s: run_runner("shakespeare_char", None, s),
    }
    if args.tuned:
        programs["runner recipe + tuned"] = lambda s: run_runner(
            "[shakespeare_char,tuned]", args.tuned, s, fresh_cache=True
        )
    results: dict[str, list[dict]] = {name: [] for name in programs}
    started = time.strftime("%Y-%m-%d %H:%M")
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="bench-nanogpt-") as scratch:
        if args.tuned:
            keep_preset_cache(args.tuned, Path(scratch))
        for r in range(args.repeats):
            order = list(programs)
            rng.shuffle(order)
            for name in order:
                load = os.getloadavg()[0]
                figures = programs[name](Path(scratch)) | {"load_before": load}
                results[name].append(figures)
                args.out.with_suffix(".json").write_text(json.dumps(results, indent=1))  # kept if a later run hangs
                print(f"repeat {r + 1} {name}: {figures}", flush=True)
    write(args, results, started)


def race(args) -> None:
    """``--device cuda``: the programs alternated, each stopped at ``--target``; results to ``--out`` (and its
    ``.json``)."""
    target = args.target if args.target is not None else 0.0
    data = [f"data.path={args.data.resolve()}"] if args.data else []
    nano_gpu, runner_gpu = NANOGPT_GPU, RUNNER_GPU
    if args.dry_run:  # the same programs and stops on the CPU, a few seconds each
        nano_gpu = [*NANOGPT_GPU, *DRY_NANOGPT]
        runner_gpu = [a for a in RUNNER_GPU if not a.startswith("trainer.device=")] + DRY_RUNNER

    def runner_run(experiment: str, extra: list[str], config_dir: Path | None):
        def go(scratch: Path) -> dict:
            folder = scratch / f"runner-{time.time_ns()}"
            search = ["--config-dir", str(config_dir.resolve())] if config_dir else []
            return raced(
                [
                    sys.executable,
                    "-m",
                    "runner",
                    *search,
                    f"+experiment={experiment}",
                    *extra,
                    *runner_gpu,
                    *data,
                    f"hydra.run.dir={folder}",
                ],
                REPO,
                target,
                args.limit_s,
                scratch,
                runner_dir=folder,
            )

        return go

    programs = {}
    if (args.nanogpt / "train.py").is_file():
        programs["nanoGPT train.py"] = lambda s: raced(
            [sys.executable, *nano_gpu, f"--out_dir={s}/nanogpt-out"], args.nanogpt, target, args.limit_s, s
        )
    else:  # CI's dry run has no copy of nanoGPT: the race still exercises runner's side
        print(f"note: {args.nanogpt}/train.py is missing: nanoGPT left out of the race", flush=True)
    programs["runner recipe (compile=default)"] = runner_run("shakespeare_char_gpu", ["compile=default"], None)
    if args.tuned and (args.tuned / "experiment" / "tuned.yaml").is_file():
        programs["runner recipe + tuned"] = runner_run("[shakespeare_char_gpu,tuned]", [], args.tuned)
    results: dict[str, list[dict]] = {name: [] for name in programs}
    started = time.strftime("%Y-%m-%d %H:%M")
    with tempfile.TemporaryDirectory(prefix="bench-nanogpt-") as scratch:
        for r in range(args.repeats):
            order = list(programs) if r % 2 == 0 else list(programs)[::-1]  # ABC CBA: drift falls on all alike
            for name in order:
                figures = programs[name](Path(scratch))
                results[name].append(figures)
                args.out.with_suffix(".json").write_text(json.dumps(results, indent=1))  # kept if a later run hangs
                print(
                    f"repeat {r + 1} {name}: time to target {figures['time_to_target_s']} s at step "
                    f"{figures['step']}; best {figures['best_val_loss']:.4f}",
                    flush=True,
                )
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    lines = [
        f"# runner's Shakespeare GPT beside nanoGPT's own train.py: wall time to validation loss <= {target}",
        "",
        f"GPU: {gpu}; torch {torch.__version__}; Python {platform.python_version()}; ran {started}.",
        "",
        f"Command: `python scripts/bench_nanogpt.py --nanogpt <nanoGPT> --device cuda --target {target} "
        f"--repeats {args.repeats}" + (" --tuned <tuned>" if args.tuned else "") + "` (its docstring says what "
        "each program runs; every run compiles cold).",
        "",
        "| program | time to target, median (s) | each run (s) | step reached | best validation loss |",
        "|---|---|---|---|---|",
    ]
    for name, runs in results.items():
        times = [x["time_to_target_s"] for x in runs]
        got = [t for t in times if t is not None]
        med = f"{statistics.median(got):.1f}" if len(got) == len(times) else f"not reached in {len(times) - len(got)}"
        best = ", ".join(f"{x['best_val_loss']:.4f}" for x in runs)
        each = ", ".join("-" if t is None else f"{t:.1f}" for t in times)
        lines.append(f"| {name} | {med} | {each} | {', '.join(str(x['step']) for x in runs)} | {best} |")
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def write(args, results: dict[str, list[dict]], started: str) -> None:
    sys.path.insert(0, str(REPO))
    from runner.measure import hardware

    machine = hardware.describe_machine()
    cpu = machine.get("cpu") or platform.processor()
    loads = "; ".join(f"{name} " + ", ".join(f"{x['load_before']:.1f}" for x in runs) for name, runs in results.items())
    command = (
        "python scripts/bench_nanogpt.py --nanogpt <nanoGPT>"
        + (" --tuned <tuned>" if args.tuned else "")
        + f" --repeats {args.repeats}"
    )
    lines = [
        "# runner's Shakespeare GPT beside nanoGPT's own train.py (CPU)",
        "",
        f"Machine: {cpu} ({machine.get('cpu_cores')} cores); torch {machine.get('torch')}; "
        f"Python {platform.python_version()}; "
        f"ran {started}.",
        "",
        f"Command: `{command}` (the module docstring says what each program runs).",
        "",
        "| program | wall time, median (s) | range (s) | validation loss at step 2000 (20 batches) "
        "| tokens/s (runner) | compile s (runner) |",
        "|---|---|---|---|---|---|",
    ]
    base = statistics.median(x["wall_s"] for x in results["nanoGPT train.py"])
    for name, runs in results.items():
        walls = [x["wall_s"] for x in runs]
        losses = ", ".join(f"{x['val_loss']:.4f}" for x in runs if x["val_loss"] is not None)
        tps = ", ".join(f"{x['tokens_per_sec']:,.0f}" for x in runs if x.get("tokens_per_sec"))
        compiled = ", ".join(f"{x['compile_s']:.1f}" for x in runs if x.get("compile_s") is not None)
        lines.append(
            f"| {name} | {statistics.median(walls):.1f} (×{statistics.median(walls) / base:.2f}) | "
            f"{min(walls):.1f}–{max(walls):.1f} | {losses} | {tps or '-'} | {compiled or '-'} |"
        )
    caches = sorted({str(x["compile_cache"]) for runs in results.values() for x in runs if x.get("compile_cache")})
    lines += [
        "",
        f"Load average (1 min) before each run: {loads}.",
        "",
        "Every run starts with empty TorchInductor and Triton caches of its own, as on a fresh node; what "
        "runner's compiled runs loaded (`summary.json` `one_time.compile_cache`): "
        + ("; ".join(caches) if caches else "nothing (no run compiled)")
        + ".",
        "",
    ]
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
