"""``python -m runner.export JOB --format torch|onnx|int8 [--weights final|ema|best] [overrides]``: export a
finished job's model, then check the exported model computes what the trained one does.

    python -m runner.export outputs/<date>/<time> --format torch        # model.pt2 (torch.export)
    python -m runner.export outputs/<date>/<time> --format onnx         # model.onnx (pip install 'runner[onnx]')
    python -m runner.export outputs/<date>/<time> --format int8         # model.int8.pt2: int8 Linear layers

The model is rebuilt as ``python -m runner.evaluate`` does, exported in fp32 and checked against the trained model
within ``TOLERANCE``; its files move into place only once checked. ``int8``: the trained model (a ``compress=qat``
job's fake-quantized one) is evaluated, converted to int8 (``runner.techniques.compress.to_int8``), evaluated again,
both accuracies printed, and the int8 model exported with ``torch.export`` and checked against itself. The formats,
the check and what was measured: docs/checkpointing.md, "Evaluate and export a finished job".
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner import trust
from runner.errors import ConfigError
from runner.evaluate import parse, rebuild

FORMATS = {"torch": ".pt2", "onnx": ".onnx", "int8": ".int8.pt2"}

#: (rtol, atol) of the check: ``|exported - trained| <= atol + rtol * |trained|`` elementwise (``torch.allclose``).
#: ONNX Runtime's own kernels differ in the last bits (measured ~2e-7 on runner's small models).
TOLERANCE = {"torch": (1e-4, 1e-5), "onnx": (1e-3, 1e-4), "int8": (1e-4, 1e-5)}

#: The first line of ``--format onnx`` without its packages.
ONNX_MISSING = (
    "--format onnx needs the onnx extra: pip install 'runner[onnx]' (onnx and onnxscript for "
    "torch.onnx.export(dynamo=True), onnxruntime for the check), or pip install onnx onnxscript "
    "onnxruntime"
)


@dataclass
class Exported:
    """What ``export`` wrote and how its check went."""

    path: Path
    format: str
    weights: str
    weights_file: str
    input_shape: tuple[int, ...]
    input_dtype: str
    dynamic_batch: bool
    checked: bool  # False: skipped (``note`` says why)
    max_abs_diff: float | None
    tolerance: tuple[float, float]
    note: str = ""
    #: ``int8``: ``{"how": "qat" | "post-training", "layers": n, "float": metrics, "int8": metrics, "float_eval_s",
    #: "int8_eval_s"}`` on the validation split, both in fp32 without autocast; None for the other formats
    int8: dict[str, Any] | None = None


def _first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0][:300]}" if lines else type(e).__name__


def example_input(data) -> Any:
    """The first 2 inputs of the validation split (fewer when a batch holds fewer), as the loader yields them: on
    the device, ``(2, *item shape)``.

    Raises:
        ConfigError: the validation split yields no batch.
    """
    for x, _ in data.eval:
        return x[:2].contiguous()
    raise ConfigError(
        "the validation split yields no batch to take the export's example input from; check the "
        "data settings (data.eval_size, the dataset's test split)"
    )


def _trace(model, x, fmt: str, path: Path) -> bool:
    """Export ``model`` on the example ``x`` to ``path``; True when the batch dimension is dynamic."""
    import torch

    dynamic = ({0: torch.export.Dim("batch", min=1)},)
    last: BaseException | None = None
    for shapes in (dynamic, None):  # a model that specializes the batch size is exported at batch 2
        try:
            if fmt in ("torch", "int8"):
                torch.export.save(torch.export.export(model, (x,), dynamic_shapes=shapes), str(path))
            else:
                torch.onnx.export(model, (x,), str(path), dynamo=True, dynamic_shapes=shapes, verbose=False)
            return shapes is not None
        except Exception as e:  # noqa: BLE001 - the exporters raise many types; the last one is reported
            last = e
    what = "torch.onnx.export(dynamo=True)" if fmt == "onnx" else "torch.export.export"
    raise ConfigError(
        f"{what} cannot export this model ({_first_line(last)}); the exporter needs a model "
        f"torch.export can trace (no data-dependent Python control flow), see "
        f"https://pytorch.org/docs/stable/export.html"
    ) from last


def _run_exported(fmt: str, path: Path, x) -> tuple[Any, str]:
    """The exported model's output on ``x`` (a CPU tensor for ONNX), or None with the reason the check is skipped."""
    import torch

    from runner.task import logits_of

    if fmt in ("torch", "int8"):
        with torch.no_grad():
            return logits_of(torch.export.load(str(path)).module()(x)), ""
    try:
        import onnxruntime as ort
    except ImportError:
        return None, "check skipped: onnxruntime is not installed (pip install onnxruntime, or 'runner[onnx]')"
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    out = session.run(None, {session.get_inputs()[0].name: x.detach().cpu().numpy()})[0]
    return torch.from_numpy(out), ""


def export(
    folder: Path,
    fmt: str,
    weights: str = "final",
    overrides: list[str] | tuple[str, ...] = (),
    policy: trust.Policy | None = None,
) -> Exported:
    """Export job ``folder``'s model (``--weights``) in format ``fmt`` (``torch``, ``onnx`` or ``int8``) next to its
    weights file, and check the exported model's output on the example input against the model's.

    ``torch``: ``.pt2`` (https://pytorch.org/docs/stable/export.html); ``onnx``: ``.onnx``, dynamo=True
    (https://pytorch.org/docs/stable/onnx_export.html); ``int8``: ``.int8.pt2``, the model after ``to_int8`` (torchao
    ``Int8Tensor`` weights, which ``torch.export.load`` rebuilds; checked against the int8 model). Input
    ``(2, *item shape)``; outputs ``(2, classes)`` or ``(2, T, vocab)`` logits. Returns the ``Exported`` record.

    Raises:
        ConfigError: ``fmt`` not torch/onnx/int8; int8 of a model without a Linear layer; onnx without its packages
            (``ONNX_MISSING``); ``rebuild``'s errors (not a job folder, missing or corrupt weights, bad overrides); an
            exporter that cannot trace the model (its first line); outputs that differ beyond ``TOLERANCE``. Nothing
            is written then.
    """
    if fmt not in FORMATS:
        raise ConfigError(
            f"--format {fmt}: use torch (model.pt2 via torch.export), onnx (model.onnx via "
            f"torch.onnx.export(dynamo=True)) or int8 (model.int8.pt2: int8 Linear layers, torchao)"
        )
    if fmt == "onnx":
        try:
            import onnx  # noqa: F401 - torch.onnx.export(dynamo=True) needs both
            import onnxscript  # noqa: F401
        except ImportError as e:
            raise ConfigError(f"{ONNX_MISSING} ({_first_line(e)})") from e
    r = rebuild(folder, weights, overrides, policy)  # what the job's config may name: runner.trust
    import torch

    from runner.task import logits_of

    model = r.model.float().to(memory_format=torch.contiguous_format)  # a portable layout, whatever the job used
    int8 = to_int8(r, model) if fmt == "int8" else None  # the int8 model is what is exported and checked
    x = example_input(r.data)
    with torch.no_grad():
        expected = logits_of(model(x)).float()
    final = r.weights_path.with_suffix(FORMATS[fmt])
    tmp = Path(tempfile.mkdtemp(prefix=".export-", dir=final.parent))
    try:
        dynamic = _trace(model, x, fmt, tmp / final.name)
        got, note = _run_exported(fmt, tmp / final.name, x)
        rtol, atol = TOLERANCE[fmt]
        diff = None
        if got is not None:
            got = got.float().to(expected.device)
            if got.shape != expected.shape:
                raise ConfigError(
                    f"the exported model returns shape {tuple(got.shape)}, the trained one "
                    f"{tuple(expected.shape)}, on the example input {tuple(x.shape)}; nothing written"
                )
            diff = (got - expected).abs().max().item()
            if not torch.allclose(got, expected, rtol=rtol, atol=atol):
                raise ConfigError(
                    f"the exported model's outputs differ from the trained model's by up to {diff:.3g} "
                    f"(tolerance rtol={rtol:g}, atol={atol:g}) on the example input {tuple(x.shape)}; "
                    f"nothing written. Export on trainer.device=cpu, or report the model"
                )
        for produced in tmp.iterdir():  # model.onnx may come with model.onnx.data: moved together, same names
            produced.replace(final.parent / produced.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Exported(
        final,
        fmt,
        weights,
        str(r.weights_path.relative_to(r.folder)),
        tuple(x.shape),
        str(x.dtype).removeprefix("torch."),
        dynamic,
        got is not None,
        diff,
        TOLERANCE[fmt],
        note,
        int8,
    )


def to_int8(r, model) -> dict[str, Any]:
    """``--format int8``: evaluate ``model`` (job ``r``'s trained model: fake-quantized after ``compress=qat``) on the
    validation split, convert its Linear layers to int8 in place (``compress.to_int8``) and evaluate it again, both
    in fp32 without autocast (the int8 model's own dtype), timed in seconds. Returns ``Exported.int8``.

    Raises:
        ConfigError: the model has no Linear layer.
    """
    import contextlib
    import time

    from runner.techniques import compress

    def evaluate() -> tuple[dict, float]:
        started = time.perf_counter()
        metrics = r.task.evaluate(model, r.data.eval, contextlib.nullcontext, r.cfg.trainer.eval_max_batches, r.env)
        return metrics, time.perf_counter() - started

    before, before_s = evaluate()
    how = compress.to_int8(model)
    after, after_s = evaluate()
    model.eval()  # the task's evaluation leaves the model in training mode (BatchNorm would export batch statistics)
    return {
        "how": how,
        "layers": len(compress.linear_layers(model)),
        "float": before,
        "int8": after,
        "float_eval_s": before_s,
        "int8_eval_s": after_s,
    }


def render(e: Exported) -> str:
    """The console lines: what was written from which weights, the input, and the check's result."""
    how = "torch.onnx.export(dynamo=True)" if e.format == "onnx" else "torch.export"
    batch = (
        "batch dimension dynamic"
        if e.dynamic_batch
        else "batch size fixed at the example's (the model did not export with a dynamic batch)"
    )
    lines = [
        f"exported {e.path} ({how}, --weights {e.weights}: {e.weights_file}; input {e.input_shape} "
        f"{e.input_dtype}, {batch})"
    ]
    runner_ = "onnxruntime (CPU)" if e.format == "onnx" else "torch.export.load(...).module()"
    rtol, atol = e.tolerance
    lines.append(
        f"check: {runner_} matches the {'int8' if e.int8 else 'trained'} model on {e.input_shape[0]} "
        f"validation inputs: max |diff| {e.max_abs_diff:.3g} (tolerance rtol={rtol:g}, atol={atol:g})"
        if e.checked
        else e.note
    )
    if e.int8:
        q = e.int8
        float_name = "fake-quantized (compress=qat)" if q["how"] == "qat" else "float"
        lines.append(f"int8 ({q['how']} conversion of {q['layers']} Linear layers; the validation split, no autocast):")
        for name, key in ((float_name, "float"), ("int8", "int8")):
            figures = ", ".join(f"{k} {'-' if v is None else f'{v:.6g}'}" for k, v in q[key].items())
            lines.append(f"  {name}: {figures} ({q[f'{key}_eval_s']:.2f} s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m runner.export JOB --format torch|onnx|int8 [--weights final|ema|best] [overrides]``; returns the
    exit status: 0, or 2 with one ``error:`` line (nothing written)."""
    args = parse(
        "python -m runner.export",
        "Export a finished job's model (torch.export, ONNX, or int8 via "
        "torchao and torch.export) and check the exported model's outputs against the model's.",
        argv,
        export=True,
    )
    try:
        policy = trust.Policy.make(args.trust, args.allow_target, args.job)
        result = export(args.job, args.format, args.weights, args.overrides, policy)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(render(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
