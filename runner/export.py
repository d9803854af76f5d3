"""``python -m runner.export JOB --format torch|onnx [--weights final|ema|best] [overrides]``: export a finished
job's model, then check the exported model computes what the trained one does.

    python -m runner.export outputs/<date>/<time> --format torch        # model.pt2 (torch.export)
    python -m runner.export outputs/<date>/<time> --format onnx         # model.onnx (pip install 'runner[onnx]')

The model is rebuilt as ``python -m runner.evaluate`` does, exported in fp32 and checked against the trained model
within ``TOLERANCE``; its files move into place only once checked. The formats, the check and what was measured:
docs/checkpointing.md, "Evaluate and export a finished job".
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

FORMATS = {"torch": ".pt2", "onnx": ".onnx"}

#: (rtol, atol) of the check: ``|exported - trained| <= atol + rtol * |trained|`` elementwise (``torch.allclose``).
#: ONNX Runtime's own kernels differ in the last bits (measured ~2e-7 on runner's small models).
TOLERANCE = {"torch": (1e-4, 1e-5), "onnx": (1e-3, 1e-4)}

#: The first line of ``--format onnx`` without its packages.
ONNX_MISSING = ("--format onnx needs the onnx extra: pip install 'runner[onnx]' (onnx and onnxscript for "
                "torch.onnx.export(dynamo=True), onnxruntime for the check), or pip install onnx onnxscript "
                "onnxruntime")


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
    raise ConfigError("the validation split yields no batch to take the export's example input from; check the "
                      "data settings (data.eval_size, the dataset's test split)")


def _trace(model, x, fmt: str, path: Path) -> bool:
    """Export ``model`` on the example ``x`` to ``path``; True when the batch dimension is dynamic."""
    import torch

    dynamic = ({0: torch.export.Dim("batch", min=1)},)
    last: BaseException | None = None
    for shapes in (dynamic, None):  # a model that specializes the batch size is exported at batch 2
        try:
            if fmt == "torch":
                torch.export.save(torch.export.export(model, (x,), dynamic_shapes=shapes), str(path))
            else:
                torch.onnx.export(model, (x,), str(path), dynamo=True, dynamic_shapes=shapes, verbose=False)
            return shapes is not None
        except Exception as e:  # noqa: BLE001 - the exporters raise many types; the last one is reported
            last = e
    what = "torch.export.export" if fmt == "torch" else "torch.onnx.export(dynamo=True)"
    raise ConfigError(f"{what} cannot export this model ({_first_line(last)}); the exporter needs a model "
                      f"torch.export can trace (no data-dependent Python control flow), see "
                      f"https://pytorch.org/docs/stable/export.html") from last


def _run_exported(fmt: str, path: Path, x) -> tuple[Any, str]:
    """The exported model's output on ``x`` (a CPU tensor for ONNX), or None with the reason the check is skipped."""
    import torch

    from runner.task import logits_of

    if fmt == "torch":
        with torch.no_grad():
            return logits_of(torch.export.load(str(path)).module()(x)), ""
    try:
        import onnxruntime as ort
    except ImportError:
        return None, "check skipped: onnxruntime is not installed (pip install onnxruntime, or 'runner[onnx]')"
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    out = session.run(None, {session.get_inputs()[0].name: x.detach().cpu().numpy()})[0]
    return torch.from_numpy(out), ""


def export(folder: Path, fmt: str, weights: str = "final", overrides: list[str] | tuple[str, ...] = (),
           policy: trust.Policy | None = None) -> Exported:
    """Export job ``folder``'s model (``--weights``) in format ``fmt`` (``torch`` or ``onnx``) next to its weights
    file, and check the exported model's output on the example input against the trained model's.

    ``torch``: ``.pt2`` (https://pytorch.org/docs/stable/export.html); ``onnx``: ``.onnx``, dynamo=True
    (https://pytorch.org/docs/stable/onnx_export.html). Input ``(2, *item shape)``; outputs ``(2, classes)`` or
    ``(2, T, vocab)`` logits. Returns the ``Exported`` record.

    Raises:
        ConfigError: ``fmt`` not torch/onnx; onnx without its packages (``ONNX_MISSING``); ``rebuild``'s errors
            (not a job folder, missing or corrupt weights, bad overrides); an exporter that cannot trace the model
            (its first line); outputs that differ beyond ``TOLERANCE``. Nothing is written then.
    """
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt}: use torch (model.pt2 via torch.export) or onnx (model.onnx via "
                          f"torch.onnx.export(dynamo=True))")
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
                raise ConfigError(f"the exported model returns shape {tuple(got.shape)}, the trained one "
                                  f"{tuple(expected.shape)}, on the example input {tuple(x.shape)}; nothing written")
            diff = (got - expected).abs().max().item()
            if not torch.allclose(got, expected, rtol=rtol, atol=atol):
                raise ConfigError(f"the exported model's outputs differ from the trained model's by up to {diff:.3g} "
                                  f"(tolerance rtol={rtol:g}, atol={atol:g}) on the example input {tuple(x.shape)}; "
                                  f"nothing written. Export on trainer.device=cpu, or report the model")
        for produced in tmp.iterdir():  # model.onnx may come with model.onnx.data: moved together, same names
            produced.replace(final.parent / produced.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Exported(final, fmt, weights, str(r.weights_path.relative_to(r.folder)), tuple(x.shape),
                    str(x.dtype).removeprefix("torch."), dynamic, got is not None, diff, TOLERANCE[fmt], note)


def render(e: Exported) -> str:
    """The console lines: what was written from which weights, the input, and the check's result."""
    how = "torch.export" if e.format == "torch" else "torch.onnx.export(dynamo=True)"
    batch = "batch dimension dynamic" if e.dynamic_batch else "batch size fixed at the example's (the model " \
                                                               "did not export with a dynamic batch)"
    lines = [f"exported {e.path} ({how}, --weights {e.weights}: {e.weights_file}; input {e.input_shape} "
             f"{e.input_dtype}, {batch})"]
    runner_ = "torch.export.load(...).module()" if e.format == "torch" else "onnxruntime (CPU)"
    rtol, atol = e.tolerance
    lines.append(f"check: {runner_} matches the trained model on {e.input_shape[0]} validation inputs: max |diff| "
                 f"{e.max_abs_diff:.3g} (tolerance rtol={rtol:g}, atol={atol:g})" if e.checked else e.note)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m runner.export JOB --format torch|onnx [--weights final|ema|best] [overrides]``; returns the exit
    status: 0, or 2 with one ``error:`` line (nothing written)."""
    args = parse("python -m runner.export", "Export a finished job's model (torch.export or ONNX) and check the "
                 "exported model's outputs against the trained model's.", argv, export=True)
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
