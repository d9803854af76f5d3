"""Model parallelism: one model split over several ranks, which see the same batches.

- ``tp``: tensor parallelism (Megatron-LM, Shoeybi et al. 2019, arXiv:1909.08053): each Linear of a plan split by
  output features (``colwise``) or input features (``rowwise``), so a colwise layer feeds its rowwise partner
  without communication and the partner's output is all-reduced: one all-reduce per pair forward and one backward
  (https://pytorch.org/docs/stable/distributed.tensor.parallel.html). The other parameters are replicated as
  DTensors, so the optimizer and gradient clipping see one kind of parameter.

  With ``distributed.tp_size`` smaller than the world size the remaining ranks are data parallel, each model copy
  sharded over them with FSDP2 (2-D: a ``(dp, tp)`` device mesh).
- ``pp``: pipeline parallelism: one stage of the model per rank (``split_stage``), each batch in micro-batches
  through them under GPipe or 1F1B (``Pipeline``); with ``distributed.pp_size`` smaller than the world size, several
  pipelines, each stage's copies data parallel (DDP).

When it pays and what each costs: docs/scaling.md, "Model parallelism".
"""

from __future__ import annotations

import fnmatch
import re
from typing import Any

import torch
from torch import nn

from runner.errors import ConfigError

#: The styles a plan may name: ``colwise_qkv`` is a colwise Linear whose output is three tensors side by side (GPT's
#: fused query, key, value): its rows are regrouped by rank first (``_group_heads``), so each rank gets its share of
#: each (``(B, T, 3 C / tp)``) to split by heads; the full weights (model.safetensors) are saved in the original order.
STYLES = ("colwise", "rowwise", "colwise_qkv")
#: Modules with no parameters of their own, which act on each feature alone: they may sit inside a colwise/rowwise
#: pair of an ``nn.Sequential`` MLP.
_ELEMENTWISE = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Dropout, nn.Identity, nn.Flatten)


def tp_plan(model: nn.Module) -> dict[str, str] | None:
    """The model's tensor-parallel plan, module-name pattern (``fnmatch``) -> style (``STYLES``): its own ``tp_plan``
    attribute (as Hugging Face's ``_tp_plan``), or, for an MLP (Linear layers and element-wise modules only), its
    Linear layers in pairs, colwise then rowwise (an odd last one stays replicated). None: no plan is known."""
    declared = getattr(model, "tp_plan", None)
    if declared:
        return dict(declared)
    leaves = [(name, m) for name, m in model.named_modules() if next(m.children(), None) is None]
    if not leaves or not all(isinstance(m, (nn.Linear, *_ELEMENTWISE)) for _, m in leaves):
        return None
    linear = [name for name, m in leaves if isinstance(m, nn.Linear)]
    plan = {}
    for first, second in zip(linear[0::2], linear[1::2]):
        plan |= {first: "colwise", second: "rowwise"}
    return plan or None


def _plan_for(model: nn.Module, tp_size: int) -> dict[str, str]:
    """The plan resolved to module names, checked. Raises ConfigError: no plan, a bad style, a width ``tp_size``
    does not divide."""
    plan = tp_plan(model)
    if plan is None:
        raise ConfigError(
            f"distributed=tp has no tensor-parallel plan for {type(model).__name__}: give the model a "
            f"`tp_plan` attribute mapping module names (fnmatch patterns) to {'/'.join(STYLES)}, as "
            f"runner.models.gpt.GPT.tp_plan does, or use distributed=fsdp"
        )
    resolved = {}
    for name, module in model.named_modules():
        style = next((s for pattern, s in plan.items() if fnmatch.fnmatchcase(name, pattern)), None)
        if style is None:
            continue
        if style not in STYLES or not isinstance(module, nn.Linear):
            raise ConfigError(
                f"tp_plan: {name} -> {style!r}: runner splits nn.Linear layers {'/'.join(STYLES)} "
                f"(this is {type(module).__name__})"
            )
        parts = 3 if style == "colwise_qkv" else 1
        width = module.in_features if style == "rowwise" else module.out_features // parts
        if width % tp_size:
            raise ConfigError(
                f"distributed.tp_size={tp_size} does not divide {name}'s {width} "
                f"{'input' if style == 'rowwise' else 'output'} features; pick a divisor"
            )
        resolved[name] = style
    if not resolved:
        raise ConfigError(f"tp_plan of {type(model).__name__} matches no Linear layer: {plan}")
    return resolved


def _styles() -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"colwise": ColwiseParallel, "rowwise": RowwiseParallel, "colwise_qkv": ColwiseParallel}


#: Wrapper segments in module names that state dicts leave out (torch.compile's, activation checkpointing's, DDP's).
_WRAPPERS = re.compile(r"(^|\.)(_orig_mod|_checkpoint_wrapped_module|module)(?=\.|$)")


def _group_heads(name: str, module: nn.Linear, tp_size: int) -> dict[str, torch.Tensor]:
    """Reorder a ``colwise_qkv`` layer's output rows ``[q; k; v]`` as ``[q_0; k_0; v_0; q_1; ...]`` (``q_r``: rank r's
    share), so that a plain colwise split gives rank r ``[q_r; k_r; v_r]``. Returns ``{state-dict key: the order that
    restores the original rows}`` for its weight and bias."""
    rows = module.out_features
    order = torch.arange(rows).view(3, tp_size, rows // 3 // tp_size).transpose(0, 1).reshape(-1)
    restore = torch.argsort(order)
    out = {}
    with torch.no_grad():
        for key, param in module.named_parameters(recurse=False):
            param.copy_(param[order.to(param.device)])
            out[f"{_WRAPPERS.sub('', name).lstrip('.')}.{key}".lstrip(".")] = restore
    return out


def _replicate_rest(model: nn.Module, mesh) -> int:
    """Every parameter not yet a DTensor becomes a replicated one (tied ones stay tied), its module taking plain
    tensors in and giving plain tensors out. Returns how many modules were so wrapped."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    placed: dict[int, nn.Parameter] = {}
    owners = 0
    for module in model.modules():
        own = [(k, p) for k, p in module._parameters.items() if p is not None and not isinstance(p, DTensor)]
        if not own:
            continue
        for key, param in own:
            if id(param) not in placed:
                placed[id(param)] = nn.Parameter(
                    distribute_tensor(param.data, mesh, [Replicate()]), requires_grad=param.requires_grad
                )
            module.register_parameter(key, placed[id(param)])

        def inputs(_, args, kwargs):
            wrap = lambda a: (
                DTensor.from_local(a, mesh, [Replicate()], run_check=False)
                if isinstance(a, torch.Tensor) and not isinstance(a, DTensor)
                else a
            )
            return tuple(wrap(a) for a in args), {k: wrap(v) for k, v in kwargs.items()}

        module.register_forward_pre_hook(inputs, with_kwargs=True)
        module.register_forward_hook(lambda _, __, out: out.to_local() if isinstance(out, DTensor) else out)
        owners += 1
    return owners


def apply_tp(model: nn.Module, mesh, tp_size: int) -> dict[str, Any]:
    """Split ``model`` over ``mesh`` (1-D, ``tp_size`` ranks) by its plan (``tp_plan``), in place; the rest replicated.
    Every rank must have built the same initial weights (same seed). Returns the details for ``summary.json``.

    Raises:
        ConfigError: no plan for this model, a width ``tp_size`` does not divide (``_plan_for``).
    """
    from torch.distributed.tensor.parallel import parallelize_module

    plan = _plan_for(model, tp_size)
    styles = _styles()
    for module in model.modules():  # a split layer's output is a view autograd forbids changing in place
        if getattr(module, "inplace", False) is True:
            module.inplace = False
    modules = dict(model.named_modules())
    model.tp_row_order = {}  # read by runner.checkpoint.full_model_state_dict: full weights in the original order
    for name, style in plan.items():
        if style == "colwise_qkv":
            model.tp_row_order |= _group_heads(name, modules[name], tp_size)
    parallelize_module(model, mesh, {name: styles[style]() for name, style in plan.items()})
    replicated = _replicate_rest(model, mesh)
    return {
        "tp_size": tp_size,
        "split_layers": len(plan),
        "replicated_modules": replicated,
        "plan": dict(sorted(plan.items())),
    }


# ------------------------------------------------------------------------------------------ pipeline parallelism


def split_stage(model: nn.Module, stage: int, stages: int) -> nn.Module:
    """``model`` cut down, in place, to pipeline stage ``stage`` of ``stages``: by its own ``pipeline_stage(stage,
    stages)`` (runner.models.gpt.GPT's), or, for an ``nn.Sequential``, its share of the children (names kept).

    Raises:
        ConfigError: neither applies, or fewer layers than stages.
    """
    if hasattr(model, "pipeline_stage"):
        blocks = len(getattr(getattr(model, "transformer", None), "h", ()) or ()) or stages
        if blocks < stages:
            raise ConfigError(
                f"distributed=pp: {stages} stages (one per rank) exceed the model's {blocks} blocks; "
                f"launch fewer processes"
            )
        return model.pipeline_stage(stage, stages)
    if not isinstance(model, nn.Sequential):
        raise ConfigError(
            f"distributed=pp cannot split {type(model).__name__} into stages: give the model a "
            f"`pipeline_stage(stage, stages)` method returning that stage's module, as "
            f"runner.models.gpt.GPT does, or make it an nn.Sequential"
        )
    names = list(model._modules)
    if len(names) < stages:
        raise ConfigError(
            f"distributed=pp: {stages} stages (one per rank) exceed the {len(names)} layers of the "
            f"nn.Sequential; launch fewer processes"
        )
    keep = set(names[len(names) * stage // stages : len(names) * (stage + 1) // stages])
    for name in names:
        if name not in keep:
            del model._modules[name]
    return model


class Pipeline:
    """A task run through a pipeline of stages, one per rank (GPipe, Huang et al. 2019, arXiv:1811.06965, or 1F1B,
    Narayanan et al. 2019, PipeDream; https://pytorch.org/docs/stable/distributed.pipelining.html): each
    ``loss(model, batch)`` runs the whole schedule over ``microbatches`` micro-batches, forward and backward
    (gradients averaged over them), and returns the last stage's mean loss times the stages (0 on the others), so
    that the loop's mean over ranks is the model's loss. ``evaluate`` runs the schedule forward only and gives every
    stage the last one's output, so every rank reports the same metrics. Every other attribute is the task's.
    ``clip`` replaces the loop's gradient clipping: the tied embedding's gradient summed between the first and last
    stage, then the norm over all stages (that weight counted once)."""

    def __init__(self, stage_module: nn.Module, task, env, schedule: str, microbatches: int, max_norm: float | None):
        import torch.distributed as dist
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        self.task, self.env, self.max_norm = task, env, max_norm
        self.stage, self.stages = env.rank % env.model_parallel, env.model_parallel
        self.first, self.last = self.stage == 0, self.stage == self.stages - 1
        self.module = stage_module
        # one pipeline per data-parallel rank, of consecutive ranks; every rank creates every group (new_group)
        first = env.rank - self.stage
        pipelines = [list(range(d * self.stages, (d + 1) * self.stages)) for d in range(env.dp_size)]
        self.group = [dist.new_group(ranks) for ranks in pipelines][env.dp_rank]
        ends = [dist.new_group([r[0], r[-1]]) for r in pipelines] if self.stages > 1 else [None] * env.dp_size
        self.tie_group, self.src = ends[env.dp_rank], first + self.stages - 1
        built = PipelineStage(stage_module, self.stage, self.stages, env.device, group=self.group)
        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        self.schedule = kind(built, n_microbatches=microbatches, loss_fn=self._loss_of)
        # the tied input embedding and output head (GPT's) live on the first and last stage: one weight, two copies
        plain = getattr(stage_module, "module", stage_module)  # inside DDP, with data parallelism
        self.tied = _tied_weight(plain, self.first, self.last) if self.stages > 1 else None

    def __getattr__(self, name: str):
        return getattr(self.task, name)

    def _loss_of(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.task.loss(lambda *_, **__: output, (None, target))

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        """One whole schedule step on ``batch`` (``x``, ``y``: the task's, batch dim first, split into the
        micro-batches), forward and backward; returns a 0-dim leaf: the last stage's mean loss x the stages, 0 on the
        others (its ``backward`` does nothing). Raises what the schedule raises (a shape the stages disagree on)."""
        x, y = batch
        losses: list[torch.Tensor] = []
        if self.first:
            self.schedule.step(x, target=y if self.last else None, losses=losses)
        else:
            self.schedule.step(target=y if self.last else None, losses=losses)
        share = torch.stack(losses).mean().detach() * self.stages if self.last else torch.zeros((), device=y.device)
        return share.requires_grad_()  # its backward is a no-op: the schedule ran the real one

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        """The whole model's output for ``x`` on every stage (the last one's, broadcast)."""
        import torch.distributed as dist

        target = self._target if self.last else None  # the schedule's loss_fn wants one
        out = self.schedule.eval(x, target=target) if self.first else self.schedule.eval(target=target)
        shape = torch.zeros(4, dtype=torch.int64, device=x.device)
        if self.last:
            shape[: out.dim()] = torch.tensor(out.shape)
        dist.broadcast(shape, self.src, group=self.group)
        dims = [int(d) for d in shape.tolist() if d]
        if not self.last:
            out = torch.empty(dims, device=x.device)
        dist.broadcast(out, self.src, group=self.group)
        return out

    def evaluate(self, model, batches, autocast, max_batches, env):
        """The task's ``evaluate`` with the whole pipeline as its model (``_forward``): the same metrics on every rank.
        Collective: every rank of the pipeline calls it, over the same batches."""

        def noting_targets():
            for x, y in batches:
                self._target = y
                yield x, y

        return self.task.evaluate(_Whole(self.module, self._forward), noting_targets(), autocast, max_batches, env)

    def finish(self, model, data, job_dir, env, seed: int) -> None:
        """No end-of-run samples (``task.sample_tokens``): a stage is not the whole model, and a one-sequence batch
        does not cut into micro-batches."""
        if env.is_main and getattr(self.task, "sample_tokens", 0):
            print(
                "note: distributed=pp writes no samples.txt (a stage is not the whole model); model.safetensors "
                "holds the whole model",
                flush=True,
            )

    def clip(self, optimizer: torch.optim.Optimizer, norm: bool = False) -> torch.Tensor | None:
        """The loop's gradient clipping for a pipeline (``optim.gradient_clipping``'s contract): the tied weight's
        gradient summed over the first and last stage, then the global L2 norm over every stage, clipped to
        ``max_norm``; returns that norm (a 0-dim tensor) when ``norm``, else None. Collective over the pipeline."""
        import torch.distributed as dist

        if self.tied is not None and self.tied.grad is not None:
            dist.all_reduce(self.tied.grad, group=self.tie_group)  # the first and last stage's shares
        if self.max_norm is None and not norm:
            return None
        grads = [
            p.grad
            for p in self.module.parameters()
            if p.grad is not None and not (self.last and self.stages > 1 and p is self.tied)
        ]
        squares = sum((g.float().pow(2).sum() for g in grads), torch.zeros((), device=self.env.device))
        dist.all_reduce(squares, group=self.group)  # DDP left every copy of a stage the same gradients
        total = squares.sqrt()
        if self.max_norm is not None:  # torch.nn.utils.clip_grad_norm_'s rule, over the whole model
            scale = (self.max_norm / (total + 1e-6)).clamp(max=1.0)
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        return total if norm else None


class _Whole(nn.Module):
    """The whole pipelined model as the task's evaluation sees it: ``forward`` runs every stage (``Pipeline._forward``);
    ``eval()``/``train()`` reach this rank's stage."""

    def __init__(self, stage: nn.Module, forward):
        super().__init__()
        self.stage, self._run = stage, forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x)


def _tied_weight(module: nn.Module, first: bool, last: bool) -> nn.Parameter | None:
    """The weight a GPT ties between its input embedding (first stage) and output head (last stage), on those
    stages; None elsewhere."""
    head = getattr(module, "lm_head", None)
    embedding = getattr(getattr(module, "transformer", None), "wte", None)
    if first and embedding is not None:
        return embedding.weight
    if last and head is not None:
        return head.weight
    return None


def pipeline(stage_module: nn.Module, task, env, cfg, plan) -> Pipeline:
    """The ``Pipeline`` of this rank's stage for ``task``, from ``distributed.pp_schedule``/``pp_microbatches``.

    Raises:
        ConfigError: a combination a pipeline cannot run: gradient accumulation (its micro-batches are the
            accumulation), a batch its micro-batches do not divide, precision=amp (one loss scale over the stages),
            a loss computed inside the model (task.loss=chunked or liger), trainer.on_nonfinite=skip.
    """
    d = cfg.distributed
    microbatches = d.pp_microbatches or 2 * env.model_parallel
    refusals = [
        (
            plan.accumulate > 1,
            f"memory.accumulate_steps={plan.accumulate}: a pipeline's micro-batches are "
            f"its accumulation; set distributed.pp_microbatches instead",
        ),
        (
            microbatches < 1 or plan.micro_batch % microbatches,
            f"distributed.pp_microbatches={microbatches} must divide dataloader.batch_size={plan.micro_batch}",
        ),
        (
            cfg.precision.name == "amp",
            "precision=amp: its loss scale would have to span the stages; use precision=bf16",
        ),
        (
            getattr(task, "loss_kind", "full") != "full" or getattr(task, "fused", None) is not None,
            "task.loss computes the loss inside the model, which a pipeline stage is not; use task.loss=full",
        ),
        (plan.skip_nonfinite, "trainer.on_nonfinite=skip: each stage would decide alone; use stop"),
    ]
    for refused, why in refusals:
        if refused:
            raise ConfigError(f"distributed=pp: {why}")
    return Pipeline(stage_module, task, env, d.pp_schedule, microbatches, cfg.optimizer.clip_grad_norm)
