"""Structured-config schemas: one dataclass per config group, stored in Hydra's ConfigStore.

Each YAML option in ``conf/<group>/`` extends ``base_<group>``, so a misspelt key or a wrong type fails at compose time
(https://hydra.cc/docs/tutorials/structured_config/schema/). Open nodes (``OPEN``, ``open_node``) and why:
docs/configuration.md, "Config groups".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from runner.config.logger import LoggerConfig
from runner.config.tools import AblationConfig, InterleaveConfig, TuneConfig
from runner.errors import ConfigError

#: Every closed list of options, declared once (checked by ``validate`` and each builder's ``check_choice``); ``None``
#: in a list: the key may be null.
CHOICES: dict[str, tuple[str | None, ...]] = {
    "data.name": ("mnist", "cifar10", "imagefolder", "synthetic", "text", "tokens", "custom"),
    "scheduler.name": ("constant", "onecycle", "cosine", "cyclic"),
    "precision.name": ("fp32", "amp", "bf16", "tf32", "fp8", "int8", "auto"),
    "precision.fp8_recipe": ("tensorwise", "rowwise"),
    "distributed.name": ("none", "ddp", "fsdp", "tp", "pp", "dp"),
    "distributed.pp_schedule": ("gpipe", "1f1b"),
    "distributed.backend": (None, "gloo", "nccl", "mpi", "xccl", "ucc"),
    "debug.name": ("off", "anomaly", "profile"),
    "compress.name": ("none", "qat", "sparse24"),
    "compile.mode": (None, "default", "reduce-overhead", "max-autotune"),
    "optimizer.impl": (None, "fused", "foreach", "loop"),
    "optimizer.lr_scaling": ("none", "linear", "sqrt"),
    "trainer.device": ("auto", "cpu", "cuda"),
    "trainer.progress": ("auto", "bar", "lines", "off"),
    "trainer.on_nonfinite": ("stop", "skip"),
    "trainer.target_weights": ("model", "ema"),
    "trainer.host_allocator": ("reuse", "system"),
    "trainer.early_stopping.mode": ("auto", "min", "max"),
    "ablation.measure": ("speed", "convergence"),
}
_NULL_MEANS = {
    "distributed.backend": "nccl on CUDA, gloo on CPU",
    "compile.mode": "compile=off",  # what null means
    "optimizer.impl": "torch's default",
}


def global_batch_size(micro_batch: int, accumulate_steps: int, world_size: int) -> int:
    """Samples per optimizer step over all ranks: ``dataloader.batch_size`` x ``memory.accumulate_steps`` x world
    size (``summary.json`` ``global_batch_size``, ``scaled_lr``, the tuners)."""
    return micro_batch * accumulate_steps * world_size


def check_choice(key: str, value: Any) -> None:
    """Refuse ``value`` for ``key`` unless it is one of ``CHOICES[key]``.

    Raises:
        ConfigError: ``<key>=<value> is not one of <the choices>`` (plus what null means where it is allowed).
    """
    allowed = CHOICES[key]
    if value in allowed:
        return
    names = ", ".join(a for a in allowed if a is not None)
    null = f" (or null: {_NULL_MEANS[key]})" if None in allowed else ""
    raise ConfigError(f"{key}={value} is not one of {names}{null}")


@dataclass
class ModelConfig:
    """``model`` group: ``_target_`` (a module class or factory) + runner's switches; an open node: any other key is a
    constructor argument (checked by ``runner.models.build``, which fills ``num_classes`` and ``in_features``)."""

    _target_: str = MISSING
    cifar_stem: bool = False  # resnets: 3x3 stride-1 stem, no max-pool (for 32x32 inputs)
    drop_bias_before_bn: bool = False  # technique 15: remove conv/linear bias that feeds a BatchNorm
    # torchvision weights: a weights enum name (IMAGENET1K_V1, DEFAULT) or a full one (ResNet18_Weights.IMAGENET1K_V1)
    # from torchvision's cache ($TORCH_HOME/hub/checkpoints); the classification head is then a fresh one
    weights: Optional[str] = None
    freeze_backbone: bool = False  # with weights: train only the new head (requires_grad=False elsewhere)


@dataclass
class GPTConfig(ModelConfig):
    """``model=gpt``: ``runner.models.gpt.GPT``, a nanoGPT-style decoder-only transformer (vocab_size from the data)."""

    _target_: str = "runner.models.gpt.GPT"
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    block_size: int = 256  # longest context (tokens); gpt.yaml: ${data.block_size}
    dropout: float = 0.0
    bias: bool = False  # biases in Linear and LayerNorm layers
    upcast_attention: bool = False  # attention in fp32 under bf16/fp16 autocast (runner/models/gpt.py: faster on CPUs)


@dataclass
class HFCausalLMConfig(ModelConfig):
    """``model=hf_causal_lm``: ``runner.models.hf.causal_lm``, a randomly initialised Hugging Face causal LM of
    ``model_type`` (``vocab_size`` from the data). An open node: any other key is a setting of that
    architecture's config class (``model.n_layer=2`` for gpt2), checked against it by ``causal_lm``."""

    _target_: str = "runner.models.hf.causal_lm"
    model_type: str = "gpt2"  # a transformers model type with a causal-LM class (gpt2, llama, mistral, ...)
    block_size: Optional[int] = 256  # context length -> the config's position count; hf_causal_lm.yaml: data's


@dataclass
class TaskConfig:
    """``task`` group: what is trained and measured (``runner.task``): loss, evaluation, throughput unit."""

    _target_: str = MISSING


@dataclass
class LanguageModelTaskConfig(TaskConfig):
    """``task=language_model``: next-token cross-entropy; eval loss, perplexity, bits per character; tokens/s."""

    _target_: str = "runner.task.LanguageModel"
    sample_tokens: int = 500  # characters generated into samples.txt after training (0 = none)
    sample_prompt: str = "\n"  # what the generation starts from
    temperature: float = 1.0  # sampling: logits / temperature
    top_k: Optional[int] = None  # sampling: keep the k most likely tokens; null = all
    # full: the head's (B, T, vocab) logits, then the cross-entropy | chunked: head and loss loss_chunk_tokens
    # positions at a time, the full logits never held (runner's GPT) | liger: Liger Kernel's fused kernel (CUDA)
    loss: str = "full"
    loss_chunk_tokens: int = 4096


@dataclass
class DataConfig:
    """``data`` group, the keys every option has: which dataset, its class count, image-only switches (recorded as
    skipped on data that are not images)."""

    name: str = MISSING  # one of CHOICES["data.name"]
    # null: from the dataset (see runner.data); synthetic: the labels' range; custom: overrides inference
    num_classes: Optional[int] = None
    normalize: bool = True  # technique 17: subtract the dataset mean, divide by its std
    augment: bool = False  # random crop (padding 4) + horizontal flip on the training set


@dataclass
class ImageDataConfig(DataConfig):
    """``data=mnist|cifar10|imagefolder|synthetic``: where the images live and how they are shaped."""

    root: str = "${oc.env:RUNNER_DATA_ROOT,${runner_data_root:}}"  # else the repo's data/ (runner.DATA_DIR)
    download: bool = False
    image_size: int = 224  # imagefolder: resize + center-crop side (px)
    # synthetic only: random inputs of this shape, made once
    shape: list[int] = field(default_factory=lambda: [3, 32, 32])
    train_size: int = 50000
    eval_size: int = 10000


@dataclass
class TextDataConfig(DataConfig):
    """``data=text``: a UTF-8 file tokenized by character; samples are windows of ``block_size`` tokens."""

    name: str = "text"
    path: Optional[str] = None
    block_size: int = 256
    train_size: Optional[int] = None  # random windows per epoch; null: train tokens // block_size
    normalize: bool = False  # an image technique: nothing to normalize in token ids


@dataclass
class TokensDataConfig(DataConfig):
    """``data=tokens``: nanoGPT's ``train.bin``/``val.bin`` (flat token ids, memory-mapped); windows of
    ``block_size`` tokens sampled as ``data=text``'s (``runner.data.tokens``)."""

    name: str = "tokens"
    train_path: Optional[str] = None  # the training split's .bin (required unless synthetic_tokens is set)
    val_path: Optional[str] = None  # the validation split's .bin (required unless synthetic_tokens is set)
    synthetic_tokens: Optional[int] = None  # both paths null: N seeded random ids (N // 10 validate), for tokens/s
    vocab_size: Optional[int] = None  # required: the number of token ids (the model's vocabulary); ids below it
    dtype: str = "uint16"  # the ids' type in the files: uint16 (nanoGPT) or uint32
    tokenizer: Optional[str] = None  # a tiktoken encoding (gpt2) to decode samples.txt; null: token ids
    block_size: int = 256
    train_size: Optional[int] = None  # random windows per epoch; null: train tokens // block_size
    normalize: bool = False  # an image technique: nothing to normalize in token ids


@dataclass
class CustomDataConfig(DataConfig):
    """``data=custom``: ``_target_`` names the user's function returning ``(train_dataset, eval_dataset)``; an open
    node: every undeclared key is a keyword argument of that function (``runner.data.custom``)."""

    name: str = "custom"
    _target_: Optional[str] = None  # <module>.<function>, e.g. my_data.tabular (my_data.py in the run folder)
    normalize: bool = False  # the function returns inputs as the model sees them


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
    lr_scaling: str = "none"  # CHOICES["optimizer.lr_scaling"], relative to base_batch_size (Goyal et al. 2017)
    base_batch_size: int = 64
    impl: Optional[str] = None  # CHOICES["optimizer.impl"]; null = torch's default
    set_to_none: bool = True  # technique 11: zero_grad(set_to_none=True) frees .grad instead of writing zeros
    clip_grad_norm: Optional[float] = None  # technique 14: max global L2 norm; null = off
    decay_all: bool = True  # false: weight decay on >= 2-D tensors only, not on biases/norm gains (nanoGPT)


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
class MuonConfig(OptimizerConfig):
    """``optimizer=muon``: Muon for the hidden matrices, AdamW for the rest, in one ``timm.optim.Muon`` (Jordan et
    al. 2024, https://kellerjordan.github.io/posts/muon/); the split and the choice of library: techniques/optim.py. The
    defaults are those of the authors' ``MuonWithAuxAdam`` (https://github.com/KellerJordan/Muon)."""

    _target_: str = "timm.optim.Muon"
    lr: float = 0.02  # the Muon matrices' LR; scaled and scheduled like any optimizer.lr
    weight_decay: float = 0.01  # decoupled, on both parts (decay_all=false spares biases and norm gains)
    momentum: float = 0.95
    nesterov: bool = True  # Muon's momentum; the AdamW part is plain AdamW either way
    ns_steps: int = 5  # Newton-Schulz iterations
    ns_coefficients: str = "original"  # timm's presets: original (Jordan's quintic), quintic, polar_express, ...
    adjust_lr_fn: Optional[str] = "original"  # update x sqrt(max(1, out/in)) as Jordan's; match_rms_adamw: Kimi
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # the AdamW part's
    adamw_lr: float = 3e-4  # the AdamW part's LR at optimizer.lr; scaled and scheduled in proportion
    adamw_eps: float = 1e-10  # the AdamW part's eps


@dataclass
class SchedulerConfig:
    """``scheduler`` group: the LR schedule, stepped per optimizer step; factors multiply the optimizer LR."""

    name: str = MISSING  # CHOICES["scheduler.name"]
    warmup_steps: int = 0  # cosine: linear warm-up over this many optimizer steps
    max_lr_factor: float = 1.0  # onecycle/cyclic: peak LR = optimizer LR x this
    pct_start: float = 0.25  # onecycle: fraction of steps spent increasing the LR
    min_lr_factor: float = 0.0  # cosine: final LR = optimizer LR x this
    base_lr_factor: float = 0.1  # cyclic: lower bound = optimizer LR x this
    cycle_steps: int = 200  # cyclic: steps of one full triangle (up + down)


@dataclass
class PrecisionConfig:
    """``precision`` group: autocast dtype and the fp16 loss scaler's settings."""

    name: str = MISSING  # CHOICES["precision.name"]
    init_scale: float = 65536.0  # amp: GradScaler's initial loss scale
    growth_interval: int = 2000  # amp: steps without inf/NaN before the scale doubles
    fp8_recipe: str = "tensorwise"  # fp8: torchao's scaling recipe, CHOICES["precision.fp8_recipe"]


@dataclass
class DistributedConfig:
    """``distributed`` group: the parallel wrapper, process-group backend and timeout (s)."""

    name: str = "none"  # CHOICES["distributed.name"]
    backend: Optional[str] = None  # CHOICES["distributed.backend"]; null = nccl on CUDA, gloo on CPU
    sync_batchnorm: bool = False
    timeout_s: int = 300
    tp_size: Optional[int] = None  # tp: ranks one model is split over (null: all); the rest data parallel (FSDP2)
    pp_size: Optional[int] = None  # pp: stages of one pipeline, one per rank (null: all); the rest data parallel (DDP)
    pp_schedule: str = "1f1b"  # pp: CHOICES["distributed.pp_schedule"], GPipe or one-forward-one-backward
    pp_microbatches: Optional[int] = None  # pp: micro-batches each batch is cut into (null: 2 per stage)


@dataclass
class MemoryConfig:
    """``memory`` group: gradient accumulation and activation checkpointing."""

    accumulate_steps: int = 1  # technique 9: micro-batches per optimizer step
    checkpointing: bool = False  # technique 8: activation checkpointing
    checkpoint_modules: Optional[list[str]] = None  # class names; null = the model's repeated blocks
    # full: each checkpointed block recomputes everything | selective: its matmuls and attention are saved (torchtitan)
    checkpoint_policy: str = "full"
    budget: Optional[float] = None  # compiled models: the fraction of activation memory kept (torch's min-cut)


@dataclass
class CompileConfig:
    """``compile`` group: ``torch.compile`` mode and options; mode null = eager."""

    mode: Optional[str] = None  # CHOICES["compile.mode"]; null = off (eager)
    fullgraph: bool = False
    dynamic: Optional[bool] = None
    regional: bool = False  # compile each repeated block (GPT blocks, ResNet blocks) instead of the whole model
    optimizer: bool = False  # compile the optimizer's step too (its LR a tensor, so a schedule does not recompile)
    # a shared compile cache folder of yours (runner/techniques/compile_cache.py): loaded before the first compile
    # (only what verifies as yours) and added to; null: a multirun's <sweep>/compile_cache, else none
    cache: Optional[str] = None


@dataclass
class CompressConfig:
    """``compress`` group: compression during training (runner/techniques/compress.py; docs/configuration.md,
    "Compression during training")."""

    name: str = "none"  # CHOICES["compress.name"]: none | qat (int8 fake-quantized Linear layers) | sparse24 (2:4)
    # sparse24: a Linear layer is made 2:4 sparse when both its in_features and out_features are >= this (and
    # multiples of 64); the first and last layers stay dense
    min_features: int = 1024


@dataclass
class DebugConfig:
    """``debug`` group: anomaly detection or a profiler window (in optimizer steps)."""

    name: str = "off"  # CHOICES["debug.name"]
    profile_wait: int = 1  # profile: schedule(wait, warmup, active) in steps
    profile_warmup: int = 1
    profile_active: int = 3


@dataclass
class EarlyStoppingConfig:
    """``trainer.early_stopping.*`` (engine/monitor.py): stop after ``patience`` evaluations without improvement."""

    metric: Optional[str] = None  # one of the task's metrics (eval_loss, eval_accuracy, ...; *_ema with EMA on)
    patience: int = 3  # evaluations without an improvement larger than min_delta
    min_delta: float = 0.0  # in the metric's unit
    mode: str = "auto"  # auto (max for accuracy, min otherwise) | min | max


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
    device: str = "auto"  # CHOICES["trainer.device"]
    target_accuracy: Optional[float] = None  # fraction in (0, 1]
    target_loss: Optional[float] = None  # eval_loss (the task's unit: nats, an MSE); time to target: first eval <= it
    stop_at_target: bool = False  # end the run at the first evaluation meeting the targets set (else: only dated)
    target_weights: str = "model"  # CHOICES: whose metrics meet the targets: the trained weights, or their EMA
    peak_tflops: Optional[float] = None  # override the device's dense peak for MFU
    reference_samples_per_sec: Optional[float] = None  # single-process figure for scaling efficiency
    progress: str = "auto"  # CHOICES["trainer.progress"]
    # stop | skip (CHOICES): a NaN/inf loss or gradient ends the run, or skips the step (counted)
    on_nonfinite: str = "stop"
    max_skipped_fraction: float = 0.5  # skip: more than this fraction of a log interval's steps skipped -> diverged
    # the speed doctor: its diagnosis after the summary, and on CUDA a profile of the last warm-up steps; false: neither
    doctor: bool = True
    # an exponential moving average of the weights (runner/techniques/ema.py), evaluated beside them and written as
    # model_ema.safetensors; e.g. 0.999; null = off
    ema_decay: Optional[float] = None
    ema_warmup: bool = False  # decay min(ema_decay, (1 + n) / (10 + n)) for update n (timm, TensorFlow)
    ema_every: int = 1  # update the average after every N-th optimizer step
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)
    deterministic: bool = False  # torch.use_deterministic_algorithms, cuDNN deterministic: bit-identical reruns
    num_threads: Optional[int] = None  # CPU intra-op threads (torch.set_num_threads); null = torch's default
    host_allocator: str = "reuse"  # CHOICES: reuse (glibc keeps freed memory; runner/techniques/prepare.py) | system


#: ``checkpoint.*`` (runner/checkpoint/): a plain node (``async`` is a keyword), checked by ``resume.settings`` there
CHECKPOINT_DEFAULTS: dict[str, Any] = {
    "every_steps": None,  # save after every N optimizer steps; null = off
    "every_minutes": 30,  # save when this much wall time passed since the last save (rank 0's clock); null = off
    "keep_last": 2,  # complete checkpoints kept; older ones are deleted
    "at_end": True,  # save one after the last step (and model.safetensors)
    "resume": "auto",  # auto (newest complete checkpoint in the job folder) | never | <checkpoint folder>
    "async": False,  # dcp.async_save: stage to CPU memory, write in a background thread
    "keep_best": False,  # best/model.safetensors + best/best.json after each evaluation improving best_metric
    "best_metric": "eval_loss",  # the metric keep_best watches (accuracy-like names: higher is better)
    "signals": ["SIGTERM", "SIGUSR1", "SIGINT"],  # checkpoint at the next step boundary, stop (preemption, Ctrl-C)
}


@dataclass
class RunnerConfig:
    """The primary config: one node per group plus the top-level switches."""

    defaults: list[Any] = field(default_factory=lambda: ["_self_"])
    task: TaskConfig = MISSING
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    dataloader: DataLoaderConfig = MISSING
    optimizer: OptimizerConfig = MISSING
    scheduler: SchedulerConfig = MISSING
    precision: PrecisionConfig = MISSING
    distributed: DistributedConfig = MISSING
    memory: MemoryConfig = MISSING
    logger: LoggerConfig = field(default_factory=LoggerConfig)  # options fill logger.<name>
    compile: CompileConfig = MISSING
    debug: DebugConfig = MISSING
    compress: CompressConfig = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    ablation: AblationConfig = field(default_factory=AblationConfig)
    tune: TuneConfig = field(default_factory=TuneConfig)
    interleave: InterleaveConfig = field(default_factory=InterleaveConfig)
    checkpoint: Any = field(default_factory=lambda: dict(CHECKPOINT_DEFAULTS))
    cudnn_benchmark: bool = False  # technique 6: cuDNN autotuner
    channels_last: bool = False  # technique 19: NHWC weights and inputs
    # the summary figure `python -m runner` returns to a Hydra sweeper (runner/objective.py METRICS: time_to_target_s,
    # eval_accuracy, eval_loss, samples_per_sec, ...); null = samples_per_sec
    optimized_metric: Optional[str] = None


#: The schema of each config group (stored as ``base_<group>``); every YAML option of the group extends it.
GROUP_SCHEMAS = {
    "task": TaskConfig,
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
    "compress": CompressConfig,
}


#: Groups whose options extend a more specific schema than ``base_<group>``: ``base_<name>`` per entry.
OPTION_SCHEMAS = {
    "optimizer": {"sgd": SGDConfig, "adamw": AdamWConfig, "lamb": LambConfig, "lars": LarsConfig, "muon": MuonConfig},
    "data": {
        "image_data": ImageDataConfig,
        "custom_data": CustomDataConfig,
        "text_data": TextDataConfig,
        "tokens_data": TokensDataConfig,
    },
    "model": {"gpt": GPTConfig, "hf_causal_lm": HFCausalLMConfig},
    "task": {"language_model": LanguageModelTaskConfig},
}
#: Schemas whose nodes accept keys they do not declare (a user's constructor/function arguments).
OPEN = (ModelConfig, CustomDataConfig, HFCausalLMConfig, TaskConfig)


def open_node(schema: type) -> DictConfig:
    """``schema`` as a config node with the struct flag off: undeclared keys can be set without ``+``
    (https://omegaconf.readthedocs.io/en/2.3_branch/usage.html#struct-flag); declared fields keep their types."""
    node = OmegaConf.structured(schema)
    OmegaConf.set_struct(node, False)
    return node


def register_configs() -> None:
    """Store the schemas: ``config_schema`` for the primary config, ``base_<group>`` per group, and the
    specific ones (``base_sgd``, ``base_image_data``, ``base_custom_data``, ...); ``OPEN`` ones unlocked."""
    cs = ConfigStore.instance()
    root = OmegaConf.structured(RunnerConfig)
    OmegaConf.set_struct(root.tune.switches, False)  # the speed tuner's own switches: names the user picks
    cs.store(name="config_schema", node=root)
    schemas = [(group, group, schema) for group, schema in GROUP_SCHEMAS.items()]
    schemas += [(group, name, schema) for group, named in OPTION_SCHEMAS.items() for name, schema in named.items()]
    for group, name, schema in schemas:
        cs.store(group=group, name=f"base_{name}", node=open_node(schema) if schema in OPEN else schema)
