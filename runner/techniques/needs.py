"""Where a technique can act: the job it is asked of (``Job``: the run config and the device) and the named
conditions on it (``Need``), each with the words the builders, the speed tuner and the doctor print. Only the
technique table (runner/techniques/__init__.py, ``Technique.why_not``) asks them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


def half_cores() -> int:
    from runner.measure import hardware

    return max(1, hardware.cpu_cores() // 2)


@dataclass(frozen=True)
class Job:
    """What decides where a technique can act: the run config ``cfg`` (a DictConfig, or a ``summary.json``'s plain
    dict), whether it runs on CUDA, the GPU's compute capability ``(major, minor)`` (None: unknown or no GPU) and
    whether the device computes bf16 natively."""

    cfg: Any
    cuda: bool = False
    capability: tuple[int, int] | None = None
    native_bf16: bool = False

    @classmethod
    def of(cls, cfg: Any, device: Any) -> "Job":
        """The job ``cfg`` on ``device`` (a ``torch.device`` or its name), its features read from this machine."""
        import torch

        from runner.measure import hardware

        device = torch.device(device)
        if device.type == "cuda":
            return cls(cfg, True, tuple(torch.cuda.get_device_capability(device)), torch.cuda.is_bf16_supported())
        return cls(cfg, False, None, hardware.cpu_has_native_bf16())

    @classmethod
    def recorded(cls, cfg: Any, device: str) -> "Job":
        """The job of a ``summary.json`` (its ``config`` and ``device`` name) as the speed doctor sees it: a GPU's
        capability unknown; native bf16 on any GPU, on a CPU as this machine has it."""
        from runner.measure import hardware

        cuda = device == "cuda"
        return cls(cfg, cuda, None, cuda or hardware.cpu_has_native_bf16())

    def get(self, key: str, default: Any = None) -> Any:
        return select(self.cfg, key, default)


@dataclass(frozen=True)
class Need:
    """One condition of where a technique acts: ``why(job)`` says why it does not hold, or None. ``candidate``: it
    decides only whether the speed tuner measures the switch from this configuration (the switch still acts when a
    user turns it on: amp on a CPU is bf16 autocast, the bf16 candidate already)."""

    why: Callable[[Job], str | None]
    candidate: bool = False


def select(cfg: Any, key: str, default: Any = None) -> Any:
    """``cfg``'s value at the dotted ``key``, for a DictConfig or a plain dict; ``default`` where it is absent."""
    node = cfg
    for part in key.split("."):
        if node is None:
            return default
        try:
            node = node[part]
        except (KeyError, TypeError, AttributeError):
            return default
    return node


def fp32(job: Job) -> str | None:  # a precision switch is measured from full precision
    return None if job.get("precision.name") in ("fp32", "tf32") else "your precision is already reduced"


def fp32_only(job: Job) -> str | None:
    name = job.get("precision.name")
    return None if name == "fp32" else f"precision={name} is not fp32: TF32 changes only fp32 matmuls and convolutions"


def native_bf16(job: Job) -> str | None:
    return None if job.native_bf16 else "this device has no native bf16"


def cpu_bf16(job: Job) -> str | None:  # amp on a CPU is bf16 autocast (fp16 with a GradScaler on CUDA)
    return None if job.cuda or job.native_bf16 else "this CPU has no native bf16 (AVX-512-BF16/AMX), amp's autocast"


def compiled(job: Job) -> str | None:
    if job.get("compile.mode") is not None:
        return None
    return (
        "it acts in torch.compile's partitioner; add compile=default (or use memory=selective, which needs no compile)"
    )


def gpt(what: str) -> Need:
    """runner's GPT (runner.models.gpt.GPT), which ``what`` needs."""
    return Need(lambda job: None if "runner.models.gpt" in str(job.get("model._target_")) else what)


def ampere(what: str, candidate: bool = False) -> Need:
    """A GPU of compute capability 8.0 or newer (Ampere, Hopper, Blackwell); ``what``: "TF32 needs"."""

    def why(job: Job) -> str | None:
        if job.capability is None or job.capability[0] >= 8:
            return None
        return f"{what} compute capability 8.0 or newer; this GPU has {job.capability[0]}.{job.capability[1]}"

    return Need(why, candidate)


def on_cuda(why: str) -> Need:
    return Need(lambda job: None if job.cuda else why, candidate=True)


def on_cpu(why: str) -> Need:
    return Need(lambda job: why if job.cuda else None, candidate=True)


def optimizer_has(argument: str) -> Need:
    """The optimizer class takes ``argument`` (``fused``, ``foreach``): what runner/techniques/optim.py passes."""

    def why(job: Job) -> str | None:
        import inspect

        from hydra.utils import get_class

        target = job.get("optimizer._target_")
        try:
            accepted = inspect.signature(get_class(target).__init__).parameters
        except Exception as e:  # noqa: BLE001 - hydra raises ImportError or ValueError
            return f"optimizer._target_={target!r} cannot be imported ({e})"
        return None if argument in accepted else f"{target} has no {argument} implementation (no {argument} argument)"

    return Need(why)


def in_memory(job: Job) -> str | None:
    from runner import IN_MEMORY_DATA

    name = job.get("data.name")
    return None if name in IN_MEMORY_DATA else f"data={name} has no in-memory form"


def host_loading(job: Job) -> str | None:
    return "dataloader.on_device=true: the batches need no DataLoader" if job.get("dataloader.on_device") else None


def no_workers(job: Job) -> str | None:
    n = job.get("dataloader.num_workers")
    return None if not n else f"dataloader.num_workers={n} already loads in worker processes"


def your_compile_mode(regional: bool) -> Need:
    """On a CPU the tuner keeps a compile mode the user chose (max-autotune is a candidate of its own)."""

    def why(job: Job) -> str | None:
        mode = job.get("compile.mode")
        if job.cuda or mode is None or (regional and not job.get("compile.regional")):
            return None
        return f"compile.mode={mode} already compiles the model"

    return Need(why, candidate=True)


def no_compression(job: Job) -> str | None:
    name = job.get("compress.name")
    return None if name in (None, "none") else f"compress={name} is on"


def syncs_often(job: Job) -> str | None:
    n = job.get("trainer.log_every")
    return None if n < 50 else f"trainer.log_every={n} already syncs at most every 50 steps"


def fewer_threads(job: Job) -> str | None:
    import torch

    return None if half_cores() != torch.get_num_threads() else "one core: no fewer threads to try"


FROM_FP32 = (Need(fp32, candidate=True),)


def token_inputs(cfg) -> bool:
    """Whether the job ``cfg`` is a language model (its inputs are token ids, not images)."""
    from runner import language_model_task  # the one test, which the ablation's resolver asks too

    task = select(cfg, "task") or {}
    return language_model_task(task.get("_target_", "")) or task.get("name") == "language_model"


def not_images(cfg) -> str | None:
    """Why the job ``cfg`` has no images for an image technique to act on, where its config tells: an MLP (it
    flattens its inputs: no 4-D weights) or synthetic inputs that are not ``(C, H, W)``; None otherwise (the
    user's own data and models: their builders record a skip, which the speed tuner's guard reads)."""
    if str(select(cfg, "model._target_")) == "runner.models.MLP":
        return "an image technique; the model (runner.models.MLP) has no convolutions"
    shape = select(cfg, "data.shape")
    if select(cfg, "data.name") == "synthetic" and shape is not None and len(shape) != 3:
        return f"an image technique; the inputs of shape {list(shape)} are not images (C, H, W)"
    return None
