"""The engine's two contracts with what it is given, written down as ``typing.Protocol``s: a ``Task`` (what is
trained and judged: ``task._target_``) and a ``Tracker`` (where the figures go). The engine (runner/engine/build.py,
runner/engine/train.py, runner/engine/evaluation.py) and ``python -m runner.evaluate`` call exactly these members and no
others, so any object that has them works: runner's ``Classification``, ``LanguageModel`` and ``Regression``
(runner/task.py), a user's own task class, ``runner.track.Tracker`` and ``NullTracker``, and the tuners'
recorders (``runner.tune.guard.LossRecorder``, ``runner.tune.lr.RangeRecorder``, subclasses of ``NullTracker``).

Structural, not nominal: nothing has to inherit from them (PEP 544, https://peps.python.org/pep-0544/), in the
way accelerate's ``GeneralTracker`` (``src/accelerate/tracking.py``) names what every tracker answers. Both are
``@runtime_checkable``, so ``isinstance(obj, Task)`` checks that every member exists; ``mismatches`` also checks
that each method takes the arguments the engine passes (``task.build`` refuses a user's task that does not, before
anything is built). A leaf: it imports no runner module, so every module may import it without a cycle.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterable, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from omegaconf import DictConfig


@runtime_checkable
class Task(Protocol):
    """What the engine asks a task (``task._target_``, built with ``task.<key>`` constructor arguments).

    ``data`` below is the engine's ``runner.data.Data`` (loaders, ``num_classes``, ``sample_shape``, ``target``,
    ``codec``), ``env`` its ``runner.distributed.Env`` (rank, world size, device). A method raises
    ``runner.errors.ConfigError`` (one line naming the key and the fix) for input it cannot take.
    """

    #: The names ``evaluate`` returns (``eval_loss`` always: ``trainer.target_loss`` and early stopping read it).
    metrics: tuple[str, ...]

    def loss(self, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The scalar training loss (0-d float tensor, with a graph) of one micro-batch ``(x, y)`` on the device;
        called under autocast. The loop divides it by the accumulation steps and calls ``backward``."""

    def evaluate(
        self,
        model: torch.nn.Module,
        batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
        autocast: Callable[[], ContextManager],
        max_batches: int | None,
        env: Any,
    ) -> dict[str, float | None]:
        """``{metric: value}`` for every name of ``metrics``, over at most ``max_batches`` batches per rank (None:
        all), reduced over the ranks; every value None when no batch was evaluated."""

    def check_target(self, target: Any) -> str | None:
        """Whether one item's target suits this task: None, or what a target must be (one clause, e.g. "a
        classification target is one class index: ..."), which the data check puts after what the target is.
        ``target`` is item 0's target as a batch holds it (``default_collate`` of that one item, row 0: a Python
        int becomes a 0-d int64 tensor, a float a 0-d float64 one), or the item's own object when that is no
        tensor (a string, a dict). Asked by ``data=custom`` for each set's first item."""

    def model_kwargs(self, data: Any) -> dict[str, int]:
        """The constructor sizes the data dictates (``num_classes``, ``vocab_size``, ``num_outputs``), each passed
        to the model when its constructor has that parameter. Raises ConfigError for data this task cannot
        train on."""

    def check(self, model: torch.nn.Module, data: Any) -> None:
        """Raises ConfigError for a model and data that do not go together, before anything is trained."""

    def tokens_per_sample(self, data: Any) -> int | None:
        """The throughput unit: None (samples/s only) or the tokens in one sample (tokens/s too)."""

    def skipped(self, cfg: DictConfig) -> dict[str, str]:
        """Switches of ``cfg`` that cannot act on this task: ``{status key: "skipped: <reason>"}``, recorded in
        ``summary.json`` ``techniques`` and never applied."""

    def finish(self, model: torch.nn.Module, data: Any, job_dir: Path, env: Any, seed: int) -> None:
        """Outputs after training (``samples.txt``), called on every rank (only rank 0 writes)."""


@runtime_checkable
class Tracker(Protocol):
    """Where the engine sends what it records (rank 0: ``runner.track.Tracker``; other ranks and the tuners: a
    ``NullTracker`` or a subclass). ``abort`` or ``finish`` is called once, last."""

    #: The W&B / MLflow run's id or None, kept in checkpoints so that a resumed run continues the same run.
    wandb_run_id: str | None
    mlflow_run_id: str | None

    def log(self, row: dict[str, Any]) -> None:
        """One ``metrics.jsonl`` row: a log interval (``step``, ``loss``, ``lr``, the meter's figures) or an
        evaluation (``step``, ``epoch``, the task's metrics)."""

    def note(self, message: str) -> None:
        """A line for the console between the figures (an evaluation starting, early stopping); not a metric."""

    def finish(self, summary: dict[str, Any]) -> None:
        """The run's summary (``summary.json``'s content): write it and close every output."""

    def abort(self, exit_code: int = 1) -> None:
        """Close every output without a summary: a failure (1), a preemption (75), Ctrl-C (130)."""


def members(protocol: type) -> list[str]:
    """The members ``protocol`` declares itself: its methods, then its annotated attributes (``metrics``)."""
    methods = [name for name, value in vars(protocol).items() if inspect.isfunction(value) and not name.startswith("_")]
    return methods + [name for name in vars(protocol).get("__annotations__", {}) if name not in methods]


def _call_mismatch(wanted: inspect.Signature, have: inspect.Signature) -> str | None:
    """Why a method of signature ``have`` cannot be called as the protocol's ``wanted`` (without ``self``):
    positionally with the protocol's arguments in order, or by their names; None when it can."""
    params = list(have.parameters.values())
    kinds = {p.kind for p in params}
    if {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD} <= kinds:
        return None  # (*args, **kwargs) takes any call
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for i, want in enumerate(wanted.parameters.values()):
        if i >= len(positional) or positional[i].name != want.name:
            return f"takes ({', '.join(map(str, params))}), not the argument {want.name!r} at position {i + 1}"
        if want.default is not want.empty and positional[i].default is positional[i].empty:
            return f"has no default for {want.name!r} (the engine may leave it out)"
    extra = [p for p in params[len(wanted.parameters) :] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    required = [p.name for p in extra if p.default is p.empty]
    return f"requires {', '.join(required)}, which the engine never passes" if required else None


def mismatches(obj: object, protocol: type) -> list[str]:
    """What keeps ``obj`` (an instance) from satisfying ``protocol``: each member it lacks (``"lacks
    check_target(target)"``) and each method whose signature the engine's call would not fit. Empty when it
    satisfies it."""
    found = []
    for name in members(protocol):
        declared = vars(protocol).get(name)
        if not hasattr(obj, name):
            found.append(f"lacks {name}" + (f"{_shown(declared)}" if inspect.isfunction(declared) else ""))
            continue
        if not inspect.isfunction(declared):
            continue
        attr = getattr(obj, name)
        if not callable(attr):
            found.append(f"has {name} = {type(attr).__name__}, not a method{_shown(declared)}")
            continue
        try:
            have = inspect.signature(attr)
        except (TypeError, ValueError):  # a builtin without a signature: cannot tell, so trusted
            continue
        why = _call_mismatch(_without_self(declared), have)
        if why is not None:
            found.append(f"{name} {why}")
    return found


def _without_self(fn: Callable) -> inspect.Signature:
    sig = inspect.signature(fn)
    return sig.replace(parameters=list(sig.parameters.values())[1:])


def _shown(fn: Callable) -> str:
    """``fn``'s parameters as the engine passes them: ``(model, batch)``."""
    return f"({', '.join(_without_self(fn).parameters)})"
