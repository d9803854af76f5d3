"""Structured-config schemas: one dataclass per config group, stored in Hydra's ConfigStore.

Each YAML option in ``conf/<group>/`` starts with ``defaults: [base_<group>, _self_]`` and only sets
values, so a misspelt key or a value of the wrong type fails at compose time with Hydra's own message
(Hydra structured-config tutorial, step 5.1:
https://hydra.cc/docs/tutorials/structured_config/schema/).

Fields that are *not* constructor arguments (``lr_scaling``, ``cifar_stem``, ...) are listed in
``RUNNER_KEYS`` of the module that consumes the group; everything else is passed to ``_target_``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class ModelConfig:
    """``model`` group: ``_target_`` (a module class or factory taking ``num_classes``) + runner switches."""

    _target_: str = MISSING
    cifar_stem: bool = False  # resnets: 3x3 stride-1 stem, no max-pool (for 32x32 inputs)
    drop_bias_before_bn: bool = False  # technique 15: remove conv/linear bias that feeds a BatchNorm


@dataclass
class DataConfig:
    """``data`` group: which dataset, where it lives, and how samples are normalized/augmented."""

    name: str = MISSING  # mnist | cifar10 | imagefolder | synthetic
    root: str = "${oc.env:RUNNER_DATA_ROOT,${runner_data_root:}}"  # else the repo's data/ (runner.DATA_DIR)
    download: bool = False
    normalize: bool = True  # technique 17: subtract the dataset mean, divide by its std
    augment: bool = False  # random crop (padding 4) + horizontal flip on the training set
    image_size: int = 224  # imagefolder: resize + center-crop side (px)
    # synthetic only: random inputs of this shape, made once
    shape: list[int] = field(default_factory=lambda: [3, 32, 32])
    num_classes: int = 10
    train_size: int = 50000
    eval_size: int = 10000


@dataclass
class DataLoaderConfig:
    """``dataloader`` group: per-rank micro-batch size (samples) and how batches reach the device."""

    batch_size: int = 64  # per-rank micro-batch x accumulate_steps = per-rank batch
    num_workers: int = 0
    pin_memory: bool = False
    persistent_workers: bool = False
    prefetch_factor: Optional[int] = None
    non_blocking: bool = False  # technique 7: asynchronous host->device copies (needs pinned memory)
    on_device: bool = False  # technique 2b: whole dataset as tensors on the device
    drop_last: bool = True


@dataclass
class OptimizerConfig:
    """``optimizer`` group, common part: LR, weight decay, LR scaling, kernel, zero_grad, clipping."""

    _target_: str = MISSING
    lr: float = 0.01
    weight_decay: float = 0.0
    lr_scaling: str = "none"  # none | linear | sqrt, relative to base_batch_size (Goyal et al. 2017)
    base_batch_size: int = 64
    impl: Optional[str] = None  # fused | foreach | loop | null (torch's default)
    set_to_none: bool = True  # technique 11: zero_grad(set_to_none=True) frees .grad instead of writing zeros
    clip_grad_norm: Optional[float] = None  # technique 14: max global L2 norm; null = off


@dataclass
class SGDConfig(OptimizerConfig):
    """``optimizer=sgd``: ``torch.optim.SGD`` with momentum."""

    _target_: str = "torch.optim.SGD"
    momentum: float = 0.9
    nesterov: bool = False


@dataclass
class AdamWConfig(OptimizerConfig):
    """``optimizer=adamw``: ``torch.optim.AdamW`` (Loshchilov & Hutter 2019)."""

    _target_: str = "torch.optim.AdamW"
    lr: float = 1e-3
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8


@dataclass
class LambConfig(OptimizerConfig):
    """``optimizer=lamb``: ``timm.optim.Lamb`` (You et al. 2019)."""

    _target_: str = "timm.optim.Lamb"
    lr: float = 1e-3
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])


@dataclass
class LarsConfig(OptimizerConfig):
    """``optimizer=lars``: ``timm.optim.Lars`` (You et al. 2017)."""

    _target_: str = "timm.optim.Lars"
    lr: float = 0.1
    momentum: float = 0.9
    trust_coeff: float = 0.001


@dataclass
class SchedulerConfig:
    """``scheduler`` group: the LR schedule, stepped per optimizer step; factors multiply the optimizer LR."""

    name: str = MISSING  # constant | onecycle | cosine | cyclic
    warmup_steps: int = 0  # cosine: linear warm-up over this many optimizer steps
    max_lr_factor: float = 1.0  # onecycle/cyclic: peak LR = optimizer LR x this
    pct_start: float = 0.25  # onecycle: fraction of steps spent increasing the LR
    min_lr_factor: float = 0.0  # cosine: final LR = optimizer LR x this
    base_lr_factor: float = 0.1  # cyclic: lower bound = optimizer LR x this
    cycle_steps: int = 200  # cyclic: steps of one full triangle (up + down)


@dataclass
class PrecisionConfig:
    """``precision`` group: autocast dtype and the fp16 loss scaler's settings."""

    name: str = MISSING  # fp32 | amp | bf16 | tf32
    init_scale: float = 65536.0  # amp: GradScaler's initial loss scale
    growth_interval: int = 2000  # amp: steps without inf/NaN before the scale doubles


@dataclass
class DistributedConfig:
    """``distributed`` group: data-parallel wrapper, process-group backend and timeout (s)."""

    name: str = "none"  # none | ddp | fsdp | dp
    backend: Optional[str] = None  # null = nccl on CUDA, gloo on CPU
    sync_batchnorm: bool = False
    timeout_s: int = 300


@dataclass
class MemoryConfig:
    """``memory`` group: gradient accumulation and activation checkpointing."""

    accumulate_steps: int = 1  # technique 9: micro-batches per optimizer step
    checkpointing: bool = False  # technique 8: activation checkpointing
    checkpoint_modules: Optional[list[str]] = None  # class names; null = the model's repeated blocks


@dataclass
class LoggerConfig:
    """``logger`` group: W&B project/entity/tags, or none."""

    name: str = MISSING  # wandb | none
    project: str = "runner"
    entity: Optional[str] = None
    tags: list[str] = field(default_factory=list)


@dataclass
class CompileConfig:
    """``compile`` group: ``torch.compile`` mode and options; mode null = eager."""

    mode: Optional[str] = None  # null = off | default | reduce-overhead | max-autotune
    fullgraph: bool = False
    dynamic: Optional[bool] = None


@dataclass
class DebugConfig:
    """``debug`` group: anomaly detection or a profiler window (in optimizer steps)."""

    name: str = "off"  # off | anomaly | profile
    profile_wait: int = 1  # profile: schedule(wait, warmup, active) in steps
    profile_warmup: int = 1
    profile_active: int = 3


@dataclass
class TrainerConfig:
    """``trainer.*``: run length, warm-up, logging/evaluation cadence (optimizer steps), device, targets."""

    max_epochs: int = 1
    max_steps: Optional[int] = None  # optimizer steps; null = epochs decide
    warmup_steps: int = 5  # steps left out of every speed figure
    log_every: int = 50
    eval_every: Optional[int] = None  # optimizer steps; null = at the end of each epoch
    eval_max_batches: Optional[int] = None  # null = the whole evaluation set
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    target_accuracy: Optional[float] = None  # fraction in (0, 1]
    peak_tflops: Optional[float] = None  # override the device's dense peak for MFU
    reference_samples_per_sec: Optional[float] = None  # single-process figure for scaling efficiency
    progress: str = "auto"  # auto | bar | lines | off


@dataclass
class AblationConfig:
    """``+experiment=ablation`` (conf/experiment/ablation.yaml, conf/ablation/variant/); see runner/ablation.py."""

    repeats: int = 3  # times each configuration runs (the sweep's outer loop)
    repeat: int = 0  # this job's repeat index, 0 .. repeats-1 (swept)
    variant: Optional[str] = None  # this job's configuration, e.g. baseline, baseline+amp, fast-amp
    kind: Optional[str] = None  # baseline | leave-one-in | fast | leave-one-out
    technique: Optional[str] = None  # the technique the variant switches on (leave-one-in) or off (leave-one-out)
    requires: Optional[str] = None  # cuda: the variant is not run (recorded as not run) on other devices
    isolate: bool = True  # inside a multirun, train each job in a fresh process (clean memory/compile state)


@dataclass
class RunnerConfig:
    """The primary config: one node per group plus the top-level switches."""

    defaults: list[Any] = field(default_factory=lambda: ["_self_"])
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    dataloader: DataLoaderConfig = MISSING
    optimizer: OptimizerConfig = MISSING
    scheduler: SchedulerConfig = MISSING
    precision: PrecisionConfig = MISSING
    distributed: DistributedConfig = MISSING
    memory: MemoryConfig = MISSING
    logger: LoggerConfig = MISSING
    compile: CompileConfig = MISSING
    debug: DebugConfig = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    ablation: AblationConfig = field(default_factory=AblationConfig)
    cudnn_benchmark: bool = False  # technique 6: cuDNN autotuner
    channels_last: bool = False  # technique 19: NHWC weights and inputs


_GROUPS = {
    "model": ModelConfig,
    "data": DataConfig,
    "dataloader": DataLoaderConfig,
    "optimizer": OptimizerConfig,
    "scheduler": SchedulerConfig,
    "precision": PrecisionConfig,
    "distributed": DistributedConfig,
    "memory": MemoryConfig,
    "logger": LoggerConfig,
    "compile": CompileConfig,
    "debug": DebugConfig,
}


def register_configs() -> None:
    """Store the schemas: ``config_schema`` for the primary config, ``base_<group>`` per group."""
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=RunnerConfig)
    for group, schema in _GROUPS.items():
        cs.store(group=group, name=f"base_{group}", node=schema)
    for name, schema in {"sgd": SGDConfig, "adamw": AdamWConfig, "lamb": LambConfig, "lars": LarsConfig}.items():
        cs.store(group="optimizer", name=f"base_{name}", node=schema)


def config_groups_help() -> str:
    """The config groups ``python -m runner --help`` lists (conf/hydra/help/runner.yaml), one line each.

    Hydra's own list (``$APP_CONFIG_GROUPS``) would also show the ``base_*`` schemas stored above as if
    they were options; they are what YAML options extend, never a choice, so this lists every group and
    option of the search path (runner's and those a ``--config-dir`` adds) except Hydra's own groups and
    the ConfigStore's ``base_*`` entries.
    """
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.object_type import ObjectType

    if not GlobalHydra.instance().is_initialized():  # resolved outside a Hydra app (e.g. --cfg hydra --resolve)
        return "(see python -m runner --help)"
    loader, store = GlobalHydra.instance().config_loader(), ConfigStore.instance()

    def groups(parent: str) -> list[str]:
        found = []
        for name in loader.list_groups(parent):
            group = f"{parent}/{name}" if parent else name
            if group != "hydra":
                found += [group, *groups(group)]
        return found

    def schemas(group: str) -> set[str]:
        try:
            return {n.removesuffix(".yaml") for n in store.list(group) if n.startswith("base_")}
        except OSError:  # no ConfigStore entry in this group
            return set()

    lines = []
    for group in sorted(groups("")):
        options = sorted(set(loader.get_group_options(group, ObjectType.CONFIG)) - schemas(group))
        if options:
            lines.append(f"{group}: {', '.join(options)}")
    return "\n".join(lines)
