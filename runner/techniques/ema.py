"""An exponential moving average (EMA) of the weights: ``trainer.ema_decay=0.999``.

After every ``trainer.ema_every``-th optimizer step, ``ema <- ema + (1 - decay) * (param - ema)`` (one
``torch._foreach_lerp_``, no host sync; ``torch.optim.swa_utils.get_ema_multi_avg_fn``, timm's ``ModelEmaV3``); with
``trainer.ema_warmup=true`` the decay of update ``n`` is ``min(decay, (1 + n) / (10 + n))`` (TensorFlow's
``ExponentialMovingAverage(num_updates=...)``). Floating-point buffers are averaged the same way
(``AveragedModel(use_buffers=True)``), integer buffers copied. The averages are tensors of the model's own kind
(DTensor shards under FSDP); ``swapped`` puts them into the model and back, and a checkpoint holds them (``EMA`` is a
DCP ``Stateful``). docs/training.md, "EMA of the weights".

Source: Polyak & Juditsky, "Acceleration of stochastic approximation by averaging" (1992); the EMA of weights in
Tarvainen & Valpola, "Mean teachers" (NeurIPS 2017); https://pytorch.org/docs/stable/optim.html#weight-averaging-swa-and-ema.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch

from runner.techniques import parallel


class EMA:
    """The moving average of ``model``'s parameters and floating buffers (see the module docstring).

    Args:
        model: the model being trained (wrapped or not: its tensors are read in place, never replaced).
        decay: in (0, 1); the weight of the old average per update.
        warmup: ramp the decay up as ``(1 + n) / (10 + n)`` over the first updates.
        every: update after every ``every``-th optimizer step.
    """

    def __init__(self, model: torch.nn.Module, decay: float, warmup: bool = False, every: int = 1):
        self.model, self.decay, self.warmup, self.every = model, decay, warmup, every
        named = list(parallel.unwrap(model).named_parameters()) + list(parallel.unwrap(model).named_buffers())
        self.names = [n for n, t in named if t.is_floating_point()]
        self.live = [t.detach() for n, t in named if t.is_floating_point()]  # views of the model's tensors, made once
        self.average = [t.clone() for t in self.live]
        self.updates = 0

    def decay_now(self) -> float:
        """The decay the next update uses (``decay``, or the warm-up's smaller value)."""
        if not self.warmup:
            return self.decay
        return min(self.decay, (1 + self.updates) / (10 + self.updates))

    @torch.no_grad()
    def update(self, step: int) -> None:
        """Move the average towards the model after optimizer step ``step`` (every ``every``-th step only)."""
        if step % self.every:
            return
        weight = 1.0 - self.decay_now()
        torch._foreach_lerp_(self.average, self.live, weight)
        self.updates += 1

    @contextlib.contextmanager
    @torch.no_grad()
    def swapped(self) -> Iterator[None]:
        """Inside the block the model holds the averaged weights (in place: a compiled or wrapped model sees
        them); after it, its own again. Costs one copy of the averaged tensors for the duration."""
        own = [t.clone() for t in self.live]
        try:
            _copy(self.live, self.average)
            yield
        finally:
            _copy(self.live, own)

    def measure_update_ms(self, device: torch.device, repeats: int = 5) -> float:
        """The time of one update in ms (median of ``repeats``, the device drained), taken while the average
        still equals the weights, so the timed updates change nothing (``lerp`` of equal tensors)."""

        def drain() -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        times = []
        saved, self.updates = self.updates, 0
        for _ in range(repeats + 1):
            drain()
            started = time.perf_counter()
            with torch.no_grad():
                torch._foreach_lerp_(self.average, self.live, 1.0 - self.decay)
            drain()
            times.append((time.perf_counter() - started) * 1e3)
        self.updates = saved
        times = sorted(times[1:])
        return times[len(times) // 2]

    # DCP Stateful: the averages by name (DTensors stay sharded), and the update count (the warm-up's n)
    def state_dict(self) -> dict[str, object]:
        """The averages under the model's names, and the update count."""
        return {"average": dict(zip(self.names, self.average)), "updates": torch.tensor(self.updates)}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Copy a checkpoint's averages in place (DCP loads into the tensors ``state_dict`` gave)."""
        loaded = state["average"]
        with torch.no_grad():
            for name, tensor in zip(self.names, self.average):
                if loaded[name] is not tensor:
                    tensor.copy_(loaded[name])
        self.updates = int(state["updates"])


def _copy(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``target.copy_(source)`` pairwise, one by one: DTensor (FSDP2) has no sharding rule for ``_foreach_copy_``."""
    for target, source in zip(targets, sources):
        target.copy_(source)
