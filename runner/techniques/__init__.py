"""The speed techniques runner switches, one entry each: the one place a technique is named.

Each ``Technique`` says, once, what every tool needs to know of it: the name the tools use for it (the speed tuner's
candidate; the ``summary.json`` ``techniques`` keys its builder records are ``statuses``; the ablation's variants
``baseline+<variant>`` / ``fast-<variant>`` are named ``variant``), the config values that switch it on (``on``) and the
command line that does (``command``: what the doctor suggests and the README's switch table shows), where it can act
(``where``: any device, CUDA only, images only), whether it changes the arithmetic (the speed tuner's numerics guard
checks those that do; those that do not only move data or work, so a resumed run may change them:
runner/checkpoint/resume.py), whether it can change what a training step costs (``step_cost``: the convergence ablation
measures samples/s only for those), the group of alternatives it belongs to (one compile mode, one optimizer kernel, one
precision) and its source. The modules beside this table apply the techniques (prepare.py, optim.py, precision.py, ...;
data ones: runner/data/loading.py); tests/test_technique_table.py checks the ablation's variants, the tuner's
candidates, the doctor's suggestions, the task's image-only skips and the README's switch table against this table.

Where a technique can act is decided here only: ``Technique.why_not(job)`` (composer's ``match``), from its
``where`` and its ``needs``, named conditions on a ``Job`` (the run config and the device: needs.py). The builders
record ``skipped: <why>`` with its words, the speed tuner offers a candidate by it (``candidate=True`` adds the needs
that make a switch worth measuring from the user's configuration: bf16 starts from fp32), the ablation runs a variant
by it and the doctor suggests by it; tests/test_technique_table.py scans the other modules for conditions of their
own.

Adding a technique: one entry here and its builder; a ``variant`` name gives it its ablation variants (variants.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from runner.techniques.needs import (
    FROM_FP32,
    Job,
    Need,
    ampere,
    compiled,
    cpu_bf16,
    fewer_threads,
    fp32_only,
    gpt,
    half_cores,
    host_loading,
    in_memory,
    native_bf16,
    no_compression,
    no_workers,
    not_images,
    on_cpu,
    on_cuda,
    optimizer_has,
    select,
    syncs_often,
    token_inputs,
    your_compile_mode,
)

#: Where a technique can act: on any device, on CUDA only, on images only (not on token ids), or both.
WHERE = ("any", "cuda", "image", "image+cuda", "tokens")


def _workers() -> int:
    from runner.measure import hardware  # torch-free until called

    return min(4, hardware.cpu_cores())


@dataclass(frozen=True)
class Technique:
    """One technique (see the module docstring). ``on`` maps dotted config keys to the values that switch it on
    (a callable value is chosen for this machine when asked: ``changes``); ``command`` is the command line, when it
    is a group option rather than ``on`` itself; ``statuses`` the ``summary.json`` ``techniques`` keys its builder
    records (default: its name); ``readme`` its row in the README's switch table."""

    name: str
    on: Mapping[str, Any]
    arithmetic: bool
    source: str
    where: str = "any"
    group: str | None = None
    command: tuple[str, ...] | None = None
    statuses: tuple[str, ...] | None = None
    variant: str | None = None
    readme: str | None = None
    tuner: bool = True  # a candidate of python -m runner.tune speed (recipe changes and debug tools are not)
    # whether it can change what one training step costs (samples/s); False: the same work per step, other numbers
    # in it (an LR schedule), so its time to target is its samples to target (runner/report/convergence.py)
    step_cost: bool = True
    equivalent: tuple[Any, ...] = ()  # other values of its first key that switch it on too (amp: precision=auto)
    cuda_only: str | None = None  # why a CUDA technique does nothing elsewhere, when more than "it acts on CUDA only"
    needs: tuple[Need, ...] = ()  # what else it needs of the job (``Need``)

    def changes(self) -> dict[str, Any]:
        """``on`` with this machine's values (a callable value called)."""
        return {k: v() if callable(v) else v for k, v in self.on.items()}

    @property
    def overrides(self) -> list[str]:
        """The command line that switches it on: ``command``, else ``on`` as ``key=value`` overrides."""
        if self.command is not None:
            return list(self.command)
        return [f"{k}={_value(v)}" for k, v in self.changes().items()]

    def is_on(self, cfg: Any) -> bool:
        """Whether ``cfg`` (a DictConfig or the plain dict of a ``summary.json``) already has it on (every key of
        ``on`` at its value; a callable value: set to anything that is not off)."""
        for i, (key, value) in enumerate(self.on.items()):
            got = select(cfg, key)
            if i == 0 and got in self.equivalent:
                continue
            if callable(value):
                if not got:
                    return False
            elif got != value:
                return False
        return True

    def keys(self) -> tuple[str, ...]:
        return tuple(self.on)

    def why_not(self, job: Job, *, candidate: bool = False) -> str | None:
        """Why this technique cannot act on ``job`` (its device, its inputs, its model, its optimizer), or None:
        the one place this is decided. ``candidate``: also why the speed tuner does not measure it from the job's
        configuration (``Need.candidate``)."""
        if "cuda" in self.where and not job.cuda:
            return self.cuda_only or "it acts on CUDA only"
        if self.where.startswith("image"):
            if token_inputs(job.cfg):
                return "an image technique; the inputs are token ids"
            if why := not_images(job.cfg):
                return why
        if self.where == "tokens" and not token_inputs(job.cfg):
            return "a language-model technique; the inputs are not token ids"
        for need in self.needs:
            if (candidate or not need.candidate) and (why := need.why(job)):
                return why
        return None


def _value(v: Any) -> str:
    return "true" if v is True else "false" if v is False else "null" if v is None else str(v)


TECHNIQUES: dict[str, Technique] = {
    t.name: t
    for t in (
        # data loading
        Technique(
            "pinned_memory",
            {"dataloader.pin_memory": True, "dataloader.non_blocking": True},
            arithmetic=False,
            where="cuda",
            group=None,
            statuses=("pin_memory", "non_blocking"),
            readme="2",
            cuda_only="page-locked memory only speeds up copies to a CUDA device",
            needs=(Need(host_loading, candidate=True),),
            source="PyTorch DataLoader docs, memory pinning; CUDA semantics, non_blocking copies",
        ),
        Technique(
            "loader_workers",
            {"dataloader.num_workers": _workers, "dataloader.persistent_workers": True},
            arithmetic=False,
            group="data",
            statuses=("num_workers", "persistent_workers"),
            readme="2",
            needs=(Need(host_loading, candidate=True), Need(no_workers, candidate=True)),
            source="PyTorch DataLoader docs, multi-process data loading",
        ),
        Technique(
            "pinned_workers",
            {
                "dataloader.num_workers": _workers,
                "dataloader.pin_memory": True,
                "dataloader.persistent_workers": True,
                "dataloader.non_blocking": True,
            },
            arithmetic=False,
            command=("dataloader=pinned",),
            statuses=("num_workers", "pin_memory"),
            variant="pinned_workers",
            readme="2",
            tuner=False,
            source="the two above together (conf/dataloader/pinned.yaml)",
        ),
        Technique(
            "on_device_data",
            {"dataloader.on_device": True},
            arithmetic=False,
            group="data",
            command=("dataloader=device",),
            variant="on_device_data",
            readme="2b",
            needs=(Need(in_memory),),
            source="airbench / hlb-CIFAR10: the dataset as tensors on the device",
        ),
        # the optimizer and the loop
        Technique(
            "fused_optimizer",
            {"optimizer.impl": "fused"},
            arithmetic=True,
            group="optimizer_impl",
            variant="fused_optimizer",
            readme="5",
            statuses=("optimizer_fused",),
            needs=(optimizer_has("fused"),),
            source="torch.optim docs, 'fused' implementations",
        ),
        Technique(
            "foreach_optimizer",
            {"optimizer.impl": "foreach"},
            arithmetic=True,
            group="optimizer_impl",
            statuses=("optimizer_foreach",),
            readme="5",
            needs=(optimizer_has("foreach"),),
            source="torch.optim docs, 'foreach' implementations",
        ),
        Technique(
            "set_to_none",
            {"optimizer.set_to_none": True},
            arithmetic=False,
            variant="set_to_none",
            readme="11",
            statuses=("zero_grad_set_to_none",),
            source="PyTorch Performance Tuning Guide: zero_grad(set_to_none=True)",
        ),
        Technique(
            "fewer_syncs",
            {"trainer.log_every": 50},
            arithmetic=False,
            variant="fewer_syncs",
            readme="7",
            needs=(Need(syncs_often, candidate=True),),
            source="PyTorch Performance Tuning Guide: avoid unnecessary CPU-GPU synchronization",
        ),
        # compile
        Technique(
            "compile",
            {"compile.mode": "default"},
            arithmetic=True,
            group="compile",
            command=("compile=default",),
            variant="compile",
            readme="18",
            needs=(your_compile_mode(regional=False),),
            source="torch.compile docs",
        ),
        Technique(
            "compile_max_autotune",
            {"compile.mode": "max-autotune"},
            arithmetic=True,
            group="compile",
            command=("compile=max-autotune",),
            statuses=("compile",),
            readme="18",
            source="torch.compile docs, mode='max-autotune'",
        ),
        Technique(
            "compile_regional",
            {"compile.mode": "default", "compile.regional": True},
            arithmetic=True,
            group="compile",
            command=("compile=default", "compile.regional=true"),
            readme="18",
            needs=(your_compile_mode(regional=True),),
            source="PyTorch recipe 'Reducing torch.compile cold start compilation time with regional compilation'",
        ),
        Technique(
            "compile_reduce_overhead",
            {"compile.mode": "reduce-overhead"},
            arithmetic=True,
            group="compile",
            where="cuda",
            command=("compile=reduce-overhead",),
            statuses=("cuda_graphs",),
            readme="18",
            cuda_only="its CUDA graphs need a GPU; on a CPU it is the default mode",
            source="torch.compile docs, mode='reduce-overhead' (CUDA graphs)",
        ),
        # one of the optimizer kernels: Inductor fuses the step's loop; torch's foreach kernels refuse its tensor LR
        Technique(
            "compiled_optimizer_step",
            {"compile.optimizer": True},
            arithmetic=True,
            group="optimizer_impl",
            command=("compile.optimizer=true",),
            variant="compiled_optimizer",
            readme="18b",
            source="PyTorch recipe 'Compiling the optimizer' (torch.compile of optimizer.step)",
        ),
        # precision
        Technique(
            "amp",
            {"precision.name": "amp"},
            arithmetic=True,
            group="precision",
            command=("precision=amp",),
            variant="amp",
            readme="4",
            equivalent=("auto",),  # auto: bf16 on GPUs that have it, else amp
            needs=(
                *FROM_FP32,
                Need(cpu_bf16),
                on_cuda("fp16 with a GradScaler acts on CUDA only (on a CPU amp is bf16, the bf16 candidate)"),
            ),
            source="PyTorch AMP recipe; Micikevicius et al. 2018",
        ),
        Technique(
            "bf16",
            {"precision.name": "bf16"},
            arithmetic=True,
            group="precision",
            command=("precision=bf16",),
            readme="4",
            needs=(*FROM_FP32, Need(native_bf16, candidate=True)),
            source="torch.autocast docs (bfloat16)",
        ),
        # the GPT's attention kept in fp32 under bf16 (runner.models.gpt.GPT's upcast_attention): on a CPU, torch's bf16
        # flash-attention backward is several times slower than fp32's at small shapes, enough to make bf16 lose
        Technique(
            "bf16_upcast_attention",
            {"precision.name": "bf16", "model.upcast_attention": True},
            arithmetic=True,
            group="precision",
            statuses=("bf16",),
            needs=(
                *FROM_FP32,
                Need(native_bf16, candidate=True),
                gpt("the model has no upcast_attention switch (runner.models.gpt.GPT has)"),
                on_cpu("on CUDA, flash attention runs in bf16 itself; fp32 would leave it"),
            ),
            source="runner.models.gpt.GPT(upcast_attention=True): bf16 with the attention in fp32",
        ),
        Technique(
            "tf32",
            {"precision.name": "tf32"},
            arithmetic=True,
            group="precision",
            where="cuda",
            command=("precision=tf32",),
            readme="4",
            needs=(Need(fp32_only, candidate=True), ampere("TF32 needs")),
            cuda_only="TF32 needs an NVIDIA GPU of compute capability 8.0 or newer; this job runs on the CPU",
            source="PyTorch CUDA semantics, TF32 on Ampere and later",
        ),
        Technique(
            "fp8",
            {"precision.name": "fp8"},
            arithmetic=True,
            group="precision",
            where="cuda",
            command=("precision=fp8",),
            readme="4b",
            tuner=False,
            source="torchao float8 training (convert_to_float8_training)",
        ),
        Technique(
            "int8",
            {"precision.name": "int8"},
            arithmetic=True,
            group="precision",
            command=("precision=int8",),
            variant="int8",
            readme="4c",  # int8 matmuls pay on INT8 tensor cores; on a CPU they ran slower than bf16
            needs=(
                *FROM_FP32,
                on_cuda("its int8 matmuls pay on a GPU with INT8 tensor cores (8.0+)"),
                ampere("int8 tensor cores need", candidate=True),
            ),
            source="torchao INT8 mixed-precision training (Int8MixedPrecisionTrainingConfig; "
            "https://github.com/pytorch/ao/tree/main/torchao/prototype/quantized_training)",
        ),
        # compression during training: what the model computes changes (int8 rounding, 2:4 pruning)
        Technique(
            "qat",
            {"compress.name": "qat"},
            arithmetic=True,
            group="compress",
            command=("compress=qat",),
            variant="qat",
            readme="21",
            tuner=False,
            source="torchao quantization-aware training (QATConfig; "
            "https://docs.pytorch.org/ao/stable/generated/torchao.quantization.qat.QATConfig.html)",
        ),
        Technique(
            "sparse24",
            {"compress.name": "sparse24"},
            arithmetic=True,
            group="compress",
            where="cuda",
            command=("compress=sparse24",),
            variant="sparse24",
            readme="21",
            cuda_only="2:4 sparse matmuls (cuSPARSELt) need a CUDA GPU of compute capability 8.0 or newer "
            "(Ampere, Hopper, Blackwell)",
            needs=(ampere("2:4 sparse matmuls (cuSPARSELt) need"), Need(no_compression, candidate=True), *FROM_FP32),
            source="torchao 2:4 sparse training (torchao.sparsity.training.SemiSparseLinear; "
            "https://github.com/pytorch/ao/tree/main/torchao/sparsity/training)",
        ),
        # images
        Technique(
            "channels_last",
            {"channels_last": True},
            arithmetic=True,
            where="image",
            variant="channels_last",
            readme="19",
            source="PyTorch channels-last memory format tutorial",
        ),
        Technique(
            "cudnn_benchmark",
            {"cudnn_benchmark": True},
            arithmetic=True,
            where="image+cuda",
            variant="cudnn_benchmark",
            readme="6",
            source="torch.backends.cudnn.benchmark docs",
            cuda_only="cuDNN autotuning exists on CUDA only",
        ),
        Technique(
            "drop_bias_before_bn",
            {"model.drop_bias_before_bn": True},
            arithmetic=True,
            where="image",
            variant="drop_bias",
            readme="15",
            tuner=False,
            source="PyTorch Performance Tuning Guide: disable bias for convolutions directly followed by BN",
        ),
        # step_cost: a subtract and a divide per batch (on the device, or in the loader): small, but not nothing
        Technique(
            "normalize",
            {"data.normalize": True},
            arithmetic=True,
            where="image",
            variant="normalize",
            readme="17",
            tuner=False,
            source="input normalization (LeCun et al. 1998, 'Efficient BackProp')",
        ),
        Technique(
            "augment",
            {"data.augment": True},
            arithmetic=True,
            where="image",
            tuner=False,
            source="random crop + flip (He et al. 2016, CIFAR-10)",
        ),
        # memory and the recipe
        Technique(
            "activation_checkpointing",
            {"memory.checkpointing": True},
            arithmetic=False,
            command=("memory=checkpointing",),
            variant="checkpointing",
            readme="8",
            tuner=False,
            source="torch.utils.checkpoint; Chen et al. 2016, 'Training Deep Nets with Sublinear Memory Cost'",
        ),
        Technique(
            "selective_checkpointing",
            {"memory.checkpointing": True, "memory.checkpoint_policy": "selective"},
            arithmetic=False,
            command=("memory=selective",),
            variant="selective",
            readme="8b",
            source="torchtitan's selective activation checkpointing; "
            "torch.utils.checkpoint.create_selective_checkpoint_contexts",
        ),
        Technique(
            "activation_memory_budget",
            {"memory.budget": 0.5},
            arithmetic=False,
            command=("memory=budget",),
            readme="8b",
            tuner=False,
            needs=(Need(compiled),),
            source="torch._functorch.config.activation_memory_budget (PyTorch blog, 'Activation checkpointing "
            "techniques')",
        ),
        # the language model's loss: the head and the cross-entropy over chunks of the sequence (runner's GPT)
        Technique(
            "chunked_loss",
            {"task.loss": "chunked"},
            arithmetic=True,
            where="tokens",
            command=("task.loss=chunked",),
            variant="chunked_loss",
            readme="20",
            needs=(gpt("the model's forward takes no targets to chunk the loss over (runner's GPT does)"),),
            source="Liger Kernel's fused linear cross-entropy (Hsu et al. 2024), in plain PyTorch chunks",
        ),
        # the recipe: what buys steps (the convergence ablation, +experiment=convergence); an LR schedule sets a factor
        # per step and costs nothing measurable, so its step_cost is False
        Technique(
            "onecycle",
            {"scheduler.name": "onecycle"},
            arithmetic=True,
            command=("scheduler=onecycle",),
            variant="onecycle",
            readme="1",
            tuner=False,
            step_cost=False,
            source="Smith & Topin 2018, 'Super-Convergence'; torch.optim.lr_scheduler.OneCycleLR",
        ),
        Technique(
            "cosine",
            {"scheduler.name": "cosine"},
            arithmetic=True,
            command=("scheduler=cosine",),
            variant="cosine",
            readme="1",
            tuner=False,
            step_cost=False,
            source="Loshchilov & Hutter 2017, 'SGDR: Stochastic Gradient Descent with Warm Restarts'",
        ),
        Technique(
            "cyclic",
            {"scheduler.name": "cyclic"},
            arithmetic=True,
            command=("scheduler=cyclic",),
            variant="cyclic",
            readme="1",
            tuner=False,
            step_cost=False,
            source="Smith 2017, 'Cyclical Learning Rates for Training Neural Networks' (arXiv:1506.01186); "
            "torch.optim.lr_scheduler.CyclicLR",
        ),
        Technique(
            "adamw",
            {"optimizer._target_": "torch.optim.AdamW"},
            arithmetic=True,
            group="optimizer",
            command=("optimizer=adamw",),
            variant="adamw",
            readme="5",
            tuner=False,
            source="Loshchilov & Hutter 2019, 'Decoupled Weight Decay Regularization'; torch.optim.AdamW",
        ),
        Technique(
            "muon",
            {"optimizer._target_": "timm.optim.Muon"},
            arithmetic=True,
            group="optimizer",
            command=("optimizer=muon",),
            variant="muon",
            readme="5",
            tuner=False,  # Newton-Schulz: a step's cost
            source="Jordan et al. 2024, 'Muon: An optimizer for hidden layers in neural networks'; timm.optim.Muon",
        ),
        # an average updated after every step: a step's cost; ema=on is conf/ema/on.yaml, these three keys
        Technique(
            "ema",
            {"trainer.ema_decay": 0.999, "trainer.ema_warmup": True, "trainer.target_weights": "ema"},
            arithmetic=True,
            command=("ema=on",),
            variant="ema",
            tuner=False,
            source="Polyak & Juditsky 1992; Tarvainen & Valpola 2017; runner/techniques/ema.py",
        ),
        # a setting of the machine: half the intra-op threads (on a busy or hyper-threaded CPU, fewer can be faster)
        Technique(
            "half_threads",
            {"trainer.num_threads": half_cores},
            arithmetic=True,
            needs=(on_cpu("CPU threads matter on a CPU job only"), Need(fewer_threads, candidate=True)),
            source="PyTorch CPU performance tuning guide: intra-op threads (torch.set_num_threads)",
        ),
    )
}


def by_variant(variant: str) -> Technique | None:
    """The technique an ablation variant names (``ablation.technique``), or None (``big_batch``, ``data_loading``:
    recipe changes and the fast preset's whole data loading, not one technique)."""
    return next((t for t in TECHNIQUES.values() if t.variant == variant), None)


def step_cost(variant_technique: str | None) -> bool:
    """Whether an ablation variant's technique (``ablation.technique``) can change what a training step costs, so
    that its samples/s must be measured: its ``Technique.step_cost``; True for a name the table lacks (the recipe
    changes ``big_batch`` and ``big_batch_sqrt``: samples/s changes with the batch; anything else: assumed, so it is
    measured rather than taken as 1); False for the reference (None)."""
    if variant_technique is None:
        return False
    t = by_variant(variant_technique)
    return True if t is None else t.step_cost


def image_only() -> dict[str, str]:
    """``summary.json`` status -> the config key that switches it, for the techniques that act on images only (a
    language model's inputs are token ids: runner.task records them as skipped)."""
    return {(t.statuses or (t.name,))[0]: t.keys()[0] for t in TECHNIQUES.values() if t.where.startswith("image")}


def variant_keys() -> dict[str, tuple[str, ...]]:
    """Ablation variant -> the config keys its technique switches, for the image-only techniques that have a
    variant (runner/sweeps/ablation.py: a variant whose keys the task skips is its reference's configuration again)."""
    return {t.variant: t.keys() for t in TECHNIQUES.values() if t.where.startswith("image") and t.variant}


def moves_data_only() -> tuple[str, ...]:
    """The config keys of the techniques that only move data or work (``arithmetic=False``) and touch no model
    state: a resumed run may change them (runner/checkpoint/resume.py)."""
    return tuple(
        dict.fromkeys(
            k
            for t in TECHNIQUES.values()
            if not t.arithmetic and t.keys()[0].startswith("dataloader.")
            for k in t.keys()
            if k != "dataloader.on_device"
        )
    )


__all__ = [
    "TECHNIQUES",
    "WHERE",
    "Job",
    "Need",
    "Technique",
    "by_variant",
    "image_only",
    "moves_data_only",
    "select",
    "step_cost",
    "token_inputs",
    "variant_keys",
]
