"""Tasks: what is trained and how it is judged (the ``task`` config group).

The engine never names a loss or a metric; it asks the task (nanoGPT: ``logits, loss = model(X, Y)``;
torchtitan: ``self.loss_fn``), an object built from ``cfg.task`` by ``_target_`` with the members of
``runner.protocols.Task`` (``build`` refuses one that lacks them; docs/design.md, rule 3). The built-in tasks:
``Classification``, ``LanguageModel`` and ``Regression`` (float targets, MSE: the worked example of adding a task,
docs/data-and-models.md).

A model's output is its logits, or an object holding them as ``.logits`` (a Hugging Face ``ModelOutput``):
``logits_of`` takes either, so the task's own loss is used, never a loss the model computes itself.
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from runner import distributed, protocols, techniques
from runner.errors import ConfigError
from runner.files import write_own
from runner.models import gpt, hf
from runner.techniques import parallel

#: Image-only switches: ``summary.json`` status key -> config key (runner/techniques/: ``where="image"``). Off a
#: task on images they do nothing.
IMAGE_ONLY = techniques.image_only()


#: What ``Classification.check_target`` says a target must be (the data check's message ends with it).
CLASS_INDEX = (
    "a classification target is one class index: a Python int or a 0-d int64 tensor (torch.long; e.g. "
    "TensorDataset(x, y.long()) with y of shape (N,))"
)


def logits_of(output) -> torch.Tensor:
    """The logits in a model's output: the output itself, or its ``.logits`` (Hugging Face models return a
    ``ModelOutput``, https://huggingface.co/docs/transformers/main_classes/output)."""
    return getattr(output, "logits", output)


def build(cfg: DictConfig):
    """The task of ``cfg.task`` (``_target_`` + its keys as constructor arguments).

    Raises:
        ConfigError: ``task._target_`` cannot be imported or called, or what it builds lacks a member of the task
            contract (``runner.protocols.Task``) or has one whose signature the engine's call does not fit.
    """
    from runner.config.targets import call, plain

    task = call("task._target_", cfg._target_, {k: v for k, v in plain(cfg).items() if k != "_target_"})
    wrong = protocols.mismatches(task, protocols.Task)
    if wrong:
        raise ConfigError(
            f"task._target_={cfg._target_!r} is not a task: its {type(task).__name__} "
            f"{'; '.join(wrong)}; give it every member of runner.protocols.Task (a worked example: "
            f"runner.task.Regression, docs/data-and-models.md#adding-a-task)"
        )
    return task


@torch.inference_mode()
def evaluation_sums(
    model: torch.nn.Module,
    batches,
    autocast,
    max_batches: int | None,
    env,
    size: int,
    sums: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> list[float]:
    """Add up ``sums(logits, y)`` (a float64 vector of ``size``) over the evaluation batches and all ranks.

    Runs under ``torch.inference_mode()`` (technique 16: no autograd graph, no version counters;
    https://pytorch.org/docs/stable/generated/torch.autograd.grad_mode.inference_mode.html), in eval mode,
    at most ``max_batches`` batches per rank (None: all); one host-device sync at the end.
    """
    model.eval()
    totals = torch.zeros(size, device=env.device, dtype=torch.float64)
    for i, (x, y) in enumerate(batches):
        if max_batches is not None and i >= max_batches:
            break
        with autocast():
            logits = logits_of(model(x))
        totals += sums(logits.float(), y)
    distributed.all_reduce_sum(totals, env)
    model.train()
    return totals.tolist()  # host-device sync


class SampleTask:
    """The hooks a task of independent samples (one target per item) leaves empty: no model check
    (``check``), no tokens (``tokens_per_sample`` is None: throughput is samples/s), no technique skipped for
    it (``skipped``), nothing written at the end (``finish``). Classification and Regression build on it."""

    def check(self, model, data) -> None:
        pass

    def tokens_per_sample(self, data) -> int | None:
        return None

    def skipped(self, cfg: DictConfig) -> dict[str, str]:
        return {}

    def finish(self, model, data, job_dir: Path, env, seed: int) -> None:
        pass


class Classification(SampleTask):
    """``task=classification``: ``model(x)`` -> logits ``(B, classes)``, ``y`` int64 ``(B,)`` class ids.

    Loss: mean cross-entropy. Evaluation: top-1 accuracy (a fraction) and mean cross-entropy (nats).
    Throughput: samples/s.
    """

    metrics = ("eval_accuracy", "eval_loss")

    def loss(self, model: torch.nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(logits_of(model(x)), y)

    def evaluate(self, model, batches, autocast, max_batches, env) -> dict[str, float]:
        def sums(logits, y):
            return torch.stack(
                [
                    (logits.argmax(1) == y).sum().double(),
                    F.cross_entropy(logits, y, reduction="sum").double(),
                    torch.tensor(y.numel(), device=y.device, dtype=torch.float64),
                ]
            )

        correct, loss_sum, count = evaluation_sums(model, batches, autocast, max_batches, env, 3, sums)
        if count == 0:  # nothing was evaluated: no figure, rather than a made-up 0.0
            return dict.fromkeys(self.metrics)
        return {"eval_accuracy": correct / count, "eval_loss": loss_sum / count}

    def model_kwargs(self, data) -> dict[str, int]:
        if data.num_classes is None:
            raise ConfigError(
                "task=classification needs labelled samples, but this data yields token windows; "
                "add task=language_model model=gpt (or +experiment=shakespeare_char)"
            )
        return {"num_classes": data.num_classes}

    def check_target(self, target) -> str | None:
        ok = isinstance(target, torch.Tensor) and target.dim() == 0 and target.dtype == torch.int64
        return None if ok else CLASS_INDEX


class LanguageModel:
    """``task=language_model``: next-token prediction on windows ``x``, ``y`` int64 ``(B, T)`` (``y`` = ``x``
    shifted by one token); ``model(x)`` -> logits ``(B, T, vocab)``, or an output holding them as ``.logits``
    (a Hugging Face causal LM: ``model=hf_causal_lm``, ``runner.models.hf``).

    Loss: mean cross-entropy over all B x T positions (nats per token). Evaluation: ``eval_loss``,
    ``eval_perplexity`` = exp(loss) and ``eval_bits_per_char`` = loss / ln 2 (bits per token; Graves 2013,
    https://arxiv.org/abs/1308.0850). Throughput: tokens/s = samples/s x T. After training, ``samples.txt``
    (``finish``; nanoGPT's ``sample.py``, https://github.com/karpathy/nanoGPT/blob/master/sample.py).
    """

    metrics = ("eval_loss", "eval_perplexity", "eval_bits_per_char")

    def __init__(
        self,
        sample_tokens: int = 500,
        sample_prompt: str = "\n",
        temperature: float = 1.0,
        top_k: int | None = None,
        loss: str = "full",
        loss_chunk_tokens: int = 4096,
    ):
        self.sample_tokens, self.sample_prompt = sample_tokens, sample_prompt
        self.temperature, self.top_k = temperature, top_k
        self.loss_kind, self.loss_chunk_tokens = loss, loss_chunk_tokens
        self.fused: Any = None  # task.loss=liger: Liger Kernel's fused linear cross-entropy (check builds it)

    def loss(self, model: torch.nn.Module, batch) -> torch.Tensor:
        x, y = batch
        if self.loss_kind == "chunked":  # the model computes it, so that DDP and FSDP see one forward
            return model(x, targets=y, chunk_tokens=self.loss_chunk_tokens)
        if self.fused is not None:
            return model(x, targets=y, fused=self.fused)
        return F.cross_entropy(logits_of(model(x)).flatten(0, 1), y.flatten())

    def _check_loss(self, model) -> None:
        """Raises ConfigError: an unknown ``task.loss``; chunked or liger on a model whose forward does not take
        targets (runner's GPT does); liger off CUDA or without the ``liger`` extra."""
        kind = self.loss_kind
        if kind not in ("full", "chunked", "liger"):
            raise ConfigError(f"task.loss={kind} must be full, chunked or liger")
        if kind == "full":
            return
        if self.loss_chunk_tokens < 1:
            raise ConfigError(f"task.loss_chunk_tokens={self.loss_chunk_tokens} must be >= 1")
        if "targets" not in inspect.signature(parallel.unwrap(model).forward).parameters:
            raise ConfigError(
                f"task.loss={kind} needs a model whose forward computes its loss from targets "
                f"(runner's GPT, model=gpt); {type(parallel.unwrap(model)).__name__} returns its logits "
                f"whole: use task.loss=full"
            )
        if kind == "liger":
            if next(model.parameters()).device.type != "cuda":
                raise ConfigError(
                    "task.loss=liger runs Liger Kernel's Triton kernels on CUDA only; on this device "
                    "use task.loss=chunked, the same chunking in plain PyTorch"
                )
            try:
                from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
            except ImportError as e:
                raise ConfigError('task.loss=liger needs Liger Kernel: pip install -e ".[liger]"') from e
            self.fused = LigerFusedLinearCrossEntropyLoss()

    def evaluate(self, model, batches, autocast, max_batches, env) -> dict[str, float]:
        def sums(logits, y):
            return torch.stack(
                [
                    F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").double(),
                    torch.tensor(y.numel(), device=y.device, dtype=torch.float64),
                ]
            )

        loss_sum, count = evaluation_sums(model, batches, autocast, max_batches, env, 2, sums)
        if count == 0:  # nothing was evaluated: no figure, rather than a made-up one
            return dict.fromkeys(self.metrics)
        loss = loss_sum / count
        return {
            "eval_loss": loss,
            "eval_perplexity": math.exp(min(loss, 700.0)),
            "eval_bits_per_char": loss / math.log(2),
        }

    def model_kwargs(self, data) -> dict[str, int]:
        if data.codec is None:
            raise ConfigError(
                "task=language_model needs token data (data=text data.path=<file>, or data=tokens "
                "data.train_path=<train.bin> ...), but this data yields labelled samples; use data=text, "
                "data=tokens or task=classification"
            )
        return {"vocab_size": data.codec.vocab_size}

    def check_target(self, target) -> str | None:
        ok = isinstance(target, torch.Tensor) and target.dim() == 1 and target.dtype == torch.int64
        return None if ok else "a language model's target is a window of token ids: an int64 tensor of shape (T,)"

    def check(self, model, data) -> None:
        """Raises ConfigError: windows longer than the model's context (``block_size``, or a Hugging Face
        config's position count), a vocabulary the model does not share, a bad sampling setting, or a prompt
        the data's ``Codec`` cannot encode (characters the text never uses; ``data=tokens``: not token ids
        below ``data.vocab_size``, or text without a tokenizer)."""
        block, (context, where) = data.sample_shape[0], hf.context_length(model)
        if context is not None and block > context:
            fix = (
                where
                if where.startswith("model.")
                else (f"model.block_size with model=hf_causal_lm, or model.config.{where.split('.')[-1]}")
            )
            raise ConfigError(
                f"data.block_size={block} is longer than the model's context {where}={context}; "
                f"lower data.block_size or raise {fix}"
            )
        vocab_size = hf.vocab_size(model)
        if vocab_size is not None and vocab_size != data.codec.vocab_size:
            where = "data.path" if data.vocab is not None else "data.vocab_size"
            raise ConfigError(
                f"the model's vocab_size={vocab_size} differs from the {data.codec.vocab_size} tokens of "
                f"{where}; drop model.vocab_size (it follows the data)"
            )
        if self.sample_tokens < 0 or self.temperature <= 0 or (self.top_k is not None and self.top_k < 1):
            raise ConfigError(
                f"task.sample_tokens={self.sample_tokens} must be >= 0, task.temperature="
                f"{self.temperature} > 0 and task.top_k={self.top_k} >= 1 or null"
            )
        if self.sample_tokens:
            data.codec.encode(self.sample_prompt)  # raises ConfigError for a prompt the data cannot encode
        self._check_loss(model)

    def tokens_per_sample(self, data) -> int:
        return data.sample_shape[0]

    def skipped(self, cfg: DictConfig) -> dict[str, str]:
        return {
            status: f"skipped: {key} is an image technique; a language model's inputs are token ids"
            for status, key in IMAGE_ONLY.items()
            if OmegaConf.select(cfg, key)
        }

    def finish(self, model, data, job_dir: Path, env, seed: int) -> None:
        """Write ``samples.txt`` (rank 0). Collective: every rank generates the same tokens (same seed), since
        an FSDP-sharded model all-gathers its parameters in each forward. Compiled modules run eagerly here
        (``torch.compiler.set_stance("force_eager")``): one-off sampling is not worth a recompile per length.
        Sampling is ``runner.models.gpt.generate`` on the model's logits (any model), fed at most
        ``data.block_size`` tokens at a time: the length the model was trained on, and the only context known for a
        model that declares none; positions past it were never trained (nanoGPT's ``crop_block_size``)."""
        if not self.sample_tokens:
            return
        plain = parallel.unwrap(model)
        prompt = torch.tensor([data.codec.encode(self.sample_prompt)], device=env.device)
        generator = torch.Generator(env.device).manual_seed(seed)
        plain.eval()
        with torch.compiler.set_stance("force_eager"):
            out = gpt.generate(
                plain,
                prompt,
                self.sample_tokens,
                self.temperature,
                self.top_k,
                generator=generator,
                context=data.sample_shape[0],
            )
        plain.train()
        if env.is_main:
            write_own(job_dir / "samples.txt", data.codec.decode(out[0].tolist()))


class Regression(SampleTask):
    """``task=regression``: ``model(x)`` -> predictions ``(B, k)`` (or ``(B,)`` when k = 1), ``y`` float ``(B,)``
    (one value per item, k = 1) or ``(B, k)``; ``check_target`` refuses anything else, so ``data=custom`` takes float
    targets with this task. The model's output size follows the targets: ``model_kwargs`` gives ``num_outputs`` = k
    (``runner.models.MLP`` takes it; a model of your own names that parameter, or fixes its output size to k).

    Loss: the mean squared error over all B x k values (``torch.nn.functional.mse_loss``, computed in float32), in
    the target's unit squared. Evaluation: ``eval_loss``, that MSE over the evaluation set, and ``eval_rmse`` = its
    square root, in the target's unit. ``trainer.target_loss`` is an MSE here. Throughput: samples/s. The worked
    example of adding a task (docs/data-and-models.md#adding-a-task).
    """

    metrics = ("eval_loss", "eval_rmse")

    def loss(self, model: torch.nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(predictions(logits_of(model(x)), y), y.float())

    def evaluate(self, model, batches, autocast, max_batches, env) -> dict[str, float]:
        def sums(out, y):
            return torch.stack(
                [
                    (predictions(out, y) - y.float()).square().sum().double(),
                    torch.tensor(y.numel(), device=y.device, dtype=torch.float64),
                ]
            )

        squared_sum, count = evaluation_sums(model, batches, autocast, max_batches, env, 2, sums)
        if count == 0:  # nothing was evaluated: no figure, rather than a made-up 0.0
            return dict.fromkeys(self.metrics)
        mse = squared_sum / count
        return {"eval_loss": mse, "eval_rmse": math.sqrt(mse)}

    def check_target(self, target) -> str | None:
        ok = (
            isinstance(target, torch.Tensor)
            and target.is_floating_point()
            and target.dim() <= 1
            and target.numel() >= 1
        )
        return (
            None
            if ok
            else (
                "a regression target is a float, or a float tensor of shape (k,) for k values per "
                "item (e.g. TensorDataset(x, y.float()) with y of shape (N,) or (N, k))"
            )
        )

    def model_kwargs(self, data) -> dict[str, int]:
        """``{"num_outputs": k}``, the values of one target. Raises ConfigError for data without float targets."""
        if data.target is None or not data.target.is_floating_point():
            what = "token windows" if data.codec is not None else "class indices"
            raise ConfigError(
                f"task=regression needs float targets (data=custom with a dataset function whose targets "
                f"are floats, shape () or (k,)), but this data yields {what}; use task=classification "
                f"or task=language_model for it"
            )
        return {"num_outputs": data.target.numel()}


def predictions(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A regression model's output ``(B, k)`` (or ``(B,)``) as float32 in the shape of its targets ``y``: ``(B,)``
    targets take a ``(B, 1)`` output's one column."""
    return out.float().reshape(y.shape)
