"""Do identical training processes run at different speeds? (issue 17: the interleaved A/A's bias)

    python scripts/process_bias.py --processes 4 --passes 20 [--model mnist|gpt] [--bf16] [--no-onednn]
                                   [--start spawn|fork] [--rehome] [--threads N] [--pin]

K processes train the same model (the MnistCNN, or ``--model gpt``: the Shakespeare recipe's 4-layer GPT, batch
12 x 64 tokens) on the same fixed batch (no data loading, no runner engine) and take turns
in slices of ``--steps`` steps after a quarter-slice of unmeasured resume steps: every process once per pass,
in a random order (RMIT, as ``hydra/launcher=interleaved`` does). It prints each process's median samples/s and
each process against the first as the mean log ratio over the passes with its standard error: a firm ratio away
from 1 between processes of one configuration is a process-level bias that pairing in time cannot cancel.

``--rehome`` clones the parameters and the optimizer state and returns freed memory to the OS (``malloc_trim``)
before every slice: if the bias came from where a process's memory landed, this would spread it over slices.
``--no-onednn`` turns PyTorch's oneDNN (mkldnn) backend off in every process (``torch.backends.mkldnn.enabled``):
convolutions fall back to PyTorch's own kernels; ``--bf16`` runs the forward pass under bf16 autocast (on a CPU,
its matmuls go through oneDNN). Environment variables reach every process too, e.g.
``ONEDNN_PRIMITIVE_CACHE_CAPACITY=0`` (oneDNN builds every primitive afresh at every call) or
``MALLOC_MMAP_THRESHOLD_=131072`` (glibc maps every large buffer afresh). Measure alone on the machine;
nothing else may train meanwhile.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import multiprocessing as mp
import os
import random
import resource
import signal
import statistics
import time


def pin_threads() -> None:
    """The main thread on the first CPU, every other thread (torch's intra-op workers) on the rest: the same
    placement in every process. The hypothesis tested: the hypervisor steals unequal time from the vCPUs
    (here 27 % of cpu0, 16 % of cpu1 over 10 s) and Linux keeps a waking thread where it last ran, so a process
    whose main thread settled on the more-stolen vCPU would be slower for its whole life."""
    cpus = sorted(os.sched_getaffinity(0))
    main = os.getpid()
    others = sorted(int(t) for t in os.listdir("/proc/self/task") if int(t) != main)
    os.sched_setaffinity(main, {cpus[0]})
    for i, tid in enumerate(others):
        os.sched_setaffinity(tid, {cpus[1:][i % (len(cpus) - 1)]})


def evict_onednn_primitives() -> None:
    """Fill oneDNN's primitive cache (an LRU of ONEDNN_PRIMITIVE_CACHE_CAPACITY entries, 1024 by default) with
    reorders of 1100 distinct shapes, so the step's own primitives are built afresh at its next call."""
    import torch

    for k in range(1, 1101):
        torch.ones(1, k).to_mkldnn()


def keep_freed_memory(libc) -> None:
    """glibc's mallopt: buffers up to 32 MiB from the heap instead of fresh mappings (M_MMAP_THRESHOLD, -3),
    and freed heap memory kept instead of returned to the OS (M_TRIM_THRESHOLD, -1), so a step's buffers reuse
    the pages of the last step's instead of page-faulting fresh ones in."""
    libc.mallopt(-3, 32 * 1024 * 1024)
    libc.mallopt(-1, 2**31 - 1)
    if os.environ.get("NO_MMAP"):
        libc.mallopt(-4, 0)


def worker(connection, options: argparse.Namespace) -> None:
    # Die with the parent (prctl PR_SET_PDEATHSIG = 1, SIGTERM): a killed parent otherwise leaves its workers
    # alive and busy, and they would skew whatever is measured next.
    libc = ctypes.CDLL("libc.so.6")
    libc.prctl(1, signal.SIGTERM)
    import torch

    if options.mallopt:
        keep_freed_memory(libc)
    if options.no_onednn:
        torch.backends.mkldnn.enabled = False
    if options.threads:
        torch.set_num_threads(options.threads)
    torch.manual_seed(0)
    if options.model == "gpt":
        from runner.gpt import GPT

        model = GPT(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128, dropout=0.0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x, y = torch.randint(0, 65, (12, 64)), torch.randint(0, 65, (12, 64))
    elif options.model == "resnet18":
        import torchvision

        model = torchvision.models.resnet18(num_classes=10)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        x, y = torch.randn(options.batch, 3, 32, 32), torch.randint(0, 10, (options.batch,))
    else:
        from runner.models import MnistCNN

        model = MnistCNN()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    items = y.numel()  # samples (MnistCNN) or tokens (GPT) per step

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=options.bf16):
            logits = model(x)
        torch.nn.functional.cross_entropy(logits.flatten(0, -2).float(), y.flatten()).backward()
        optimizer.step()

    for _ in range(5):
        step()
    connection.send("ready")
    while (steps := connection.recv()) is not None:
        if options.pin:
            pin_threads()
        if options.rehome:
            with torch.no_grad():
                for p in model.parameters():
                    p.data = p.data.clone()
                for state in optimizer.state.values():
                    for key, value in list(state.items()):
                        if torch.is_tensor(value):
                            state[key] = value.clone()
            libc.malloc_trim(0)
        if options.evict:
            evict_onednn_primitives()
        for _ in range(steps // 4):
            step()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        started = time.perf_counter()
        for _ in range(steps):
            step()
        elapsed = time.perf_counter() - started
        connection.send((steps * items / elapsed,
                         (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / steps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--passes", type=int, default=20)
    parser.add_argument("--steps", type=int, default=60, help="measured steps per slice")
    parser.add_argument("--model", choices=("mnist", "gpt", "resnet18"), default="mnist")
    parser.add_argument("--bf16", action="store_true", help="the forward pass under bf16 autocast")
    parser.add_argument("--no-onednn", action="store_true", help="torch.backends.mkldnn.enabled = False")
    parser.add_argument("--evict", action="store_true", help="evict oneDNN's cached primitives before every "
                        "slice, so each slice's are built afresh")
    parser.add_argument("--start", choices=("spawn", "fork"), default="spawn")
    parser.add_argument("--rehome", action="store_true")
    parser.add_argument("--mallopt", action="store_true", help="keep_freed_memory in each process")
    parser.add_argument("--batch", type=int, default=64, help="resnet18's batch size")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads in each process")
    parser.add_argument("--pin", action="store_true", help="pin_threads before every slice: the main thread on "
                        "the first CPU, the others on the rest, in every process")
    args = parser.parse_args()
    ctx = mp.get_context(args.start)
    connections = []
    for _ in range(args.processes):
        mine, theirs = ctx.Pipe()
        ctx.Process(target=worker, args=(theirs, args)).start()
        connections.append(mine)
    for c in connections:
        c.recv()
    rng, results = random.Random(0), [[] for _ in connections]
    fault_counts = [[] for _ in connections]
    for _ in range(args.passes):
        order = list(range(len(connections)))
        rng.shuffle(order)
        for i in order:
            connections[i].send(args.steps)
            speed, faults = connections[i].recv()
            results[i].append(speed)
            fault_counts[i].append(faults)
    for c in connections:
        c.send(None)
    medians = [statistics.median(r) for r in results]
    flags = [name for name in ("bf16", "no_onednn", "evict", "rehome", "pin", "mallopt") if getattr(args, name)]
    unit = "tokens/s" if args.model == "gpt" else "samples/s"
    print(f"{args.model} {args.start} {' '.join(flags)}: medians {[round(m) for m in medians]} {unit}, "
          f"spread {max(medians) / min(medians) - 1:.1%}; minor page faults per step "
          f"{[round(statistics.median(f)) for f in fault_counts]}")
    for i in range(1, len(results)):
        logs = [math.log(a / b) for a, b in zip(results[i], results[0])]
        se = statistics.stdev(logs) / math.sqrt(len(logs))
        print(f"  process {i} / process 0: x{math.exp(statistics.mean(logs)):.3f} (2 s.e. ±{2 * se:.1%})")


if __name__ == "__main__":
    main()
