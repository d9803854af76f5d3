"""What ``compress=qat`` costs in accuracy and what its int8 export buys in CPU inference; writes
docs/benchmarks/int8-export-cpu-<date>.md.

    python scripts/bench_int8_export.py                      # MNIST CNN and an MLP, one epoch each, 20 repeats
    python scripts/bench_int8_export.py --steps 60 --repeats 3 --out /tmp/int8.md   # a quick check that it runs

For each model: a float job (``compress=none``) and a QAT job (``compress=qat``) of the same seed on the embedded
MNIST, each a fresh ``python -m runner`` process; then ``python -m runner.export <QAT job> --format int8`` (in this
process) converts the QAT weights to int8 and evaluates both on the whole validation split. Inference: the float
job's model (eager ``nn.Module``) against the int8 export (``torch.export.load(model.int8.pt2).module()``), at batch 1
and 256 of validation images, eager and under ``torch.compile`` (compile time left out), the kinds alternated within
each repeat; a repeat's figure is the mean ms per batch over enough calls for ~0.2 s. The page gives the median and
[min-max] over the repeats, the machine and its load average. Run it alone on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's runner, wherever the script runs from

MODELS = {"mnist_cnn": ["model=mnist_cnn"], "mlp 784-512-512-10": ["model=mlp", "model.hidden=512", "model.depth=2"]}
BATCHES = (1, 256)


def train(folder: Path, overrides: list[str], threads: int, steps: int | None) -> dict:
    """One ``python -m runner`` job into ``folder``; its summary.json."""
    cmd = [
        sys.executable,
        "-m",
        "runner",
        *overrides,
        f"trainer.num_threads={threads}",
        "logger=none",
        "trainer.progress=off",
        "trainer.doctor=false",
        f"hydra.run.dir={folder}",
    ]
    cmd += [f"trainer.max_steps={steps}"] if steps else []
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(REPO)}
    subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True)
    return json.loads((folder / "summary.json").read_text())


def images(data, n: int):
    """The first ``n`` validation inputs, ``(n, 1, 28, 28)``."""
    import torch

    got = []
    for x, _ in data.eval:
        got.append(x)
        if sum(len(g) for g in got) >= n:
            break
    return torch.cat(got)[:n].contiguous()


def ms_per_batch(model, x, seconds: float = 0.2) -> float:
    import torch

    with torch.inference_mode():
        model(x)
        calls, started = 0, time.perf_counter()
        while calls == 0 or time.perf_counter() - started < seconds:
            model(x)
            calls += 1
    return (time.perf_counter() - started) / calls * 1e3


def measure(float_dir: Path, qat_dir: Path, repeats: int) -> tuple[dict, dict]:
    """(kind, batch) -> ms per batch over the repeats; kind -> compile seconds."""
    import torch

    from runner.evaluate import rebuild

    r = rebuild(float_dir)
    models = {"float": r.model, "int8 export": torch.export.load(str(qat_dir / "model.int8.pt2")).module()}
    inputs = {b: images(r.data, b) for b in BATCHES}
    compile_s = {}
    for name in list(models):
        started = time.perf_counter()
        models[f"{name}, compiled"] = compiled = torch.compile(models[name])
        for x in inputs.values():  # each batch size compiled (and any recompile) before the clock
            ms_per_batch(compiled, x, seconds=0)
        compile_s[name] = time.perf_counter() - started
    times: dict = {(k, b): [] for k in models for b in BATCHES}
    for _ in range(repeats):
        for b, x in inputs.items():
            for kind, model in models.items():
                times[(kind, b)].append(ms_per_batch(model, x))
    return times, compile_s


def cell(values: list[float]) -> str:
    return f"{statistics.median(values):.3g} [{min(values):.3g}-{max(values):.3g}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, help="optimizer steps per job (default: one epoch)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads, training and inference")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    out = a.out or REPO / "docs" / "benchmarks" / f"int8-export-cpu-{time.strftime('%Y-%m-%d')}.md"
    import torch

    from runner.export import export
    from runner.measure import hardware

    torch.set_num_threads(a.threads)
    warnings.filterwarnings("ignore", message="Int8Tensor does not implement _stable_hash_for_caching")
    load_start = os.getloadavg()[0]
    accuracy, speed = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in MODELS.items():
            float_dir, qat_dir = Path(tmp) / f"{name}-float", Path(tmp) / f"{name}-qat"
            plain = train(float_dir, overrides, a.threads, a.steps)
            qat = train(qat_dir, [*overrides, "compress=qat"], a.threads, a.steps)
            q = export(qat_dir, "int8").int8
            f_acc, qat_acc, i_acc = plain["eval_accuracy"], q["float"]["eval_accuracy"], q["int8"]["eval_accuracy"]
            accuracy.append(
                f"| {name} | {plain['steps']} | {f_acc:.4f} | {qat_acc:.4f} | {i_acc:.4f} | "
                f"{(i_acc - f_acc) * 100:+.2f} | {qat['samples_per_sec'] / plain['samples_per_sec']:.2f} |"
            )
            times, compile_s = measure(float_dir, qat_dir, a.repeats)
            for b in BATCHES:
                for mode in ("", ", compiled"):
                    f, i = times[(f"float{mode}", b)], times[(f"int8 export{mode}", b)]
                    ratio = [x / y for x, y in zip(f, i)]
                    speed.append(
                        f"| {name} | {b} | {mode.strip(', ') or 'eager'} | {cell(f)} | {cell(i)} | {cell(ratio)} |"
                    )
            speed.append(f"| {name} | | compile s | {compile_s['float']:.1f} | {compile_s['int8 export']:.1f} | |")
    load_end = os.getloadavg()[0]
    cpu = hardware.device_name(torch.device("cpu"))
    lines = [
        f"# compress=qat and its int8 export on a CPU ({time.strftime('%Y-%m-%d')})",
        "",
        f"`python scripts/bench_int8_export.py {' '.join(sys.argv[1:])}`; {cpu}, {os.cpu_count()} cores, "
        f"{a.threads} thread(s); torch {torch.__version__}, Python {platform.python_version()}; load average "
        f"{load_start:.2f} at the start, {load_end:.2f} at the end.",
        "",
        "## Accuracy on the MNIST validation split (10,000 images)",
        "",
        "The float job (`compress=none`) and the QAT job (`compress=qat`) train the same seed; the QAT job's "
        "fake-quantized model and its int8 export are evaluated by `python -m runner.export <job> --format int8`. "
        "Δ: the int8 export's accuracy minus the float job's, in percentage points; samples/s: the QAT job's "
        "training speed ÷ the float job's.",
        "",
        "| model | steps | float | QAT (fake-quantized) | int8 export | Δ pp | QAT samples/s ÷ float |",
        "|---|---|---|---|---|---|---|",
        *accuracy,
        "",
        "## Inference, ms per batch",
        "",
        f"Median [min-max] of {a.repeats} repeats; ×: float ÷ int8 per repeat (> 1: the int8 export is faster).",
        "",
        "| model | batch | mode | float ms | int8 export ms | × |",
        "|---|---|---|---|---|---|",
        *speed,
        "",
    ]
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())


if __name__ == "__main__":
    main()
