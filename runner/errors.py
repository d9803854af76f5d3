"""The one exception type for bad input: it names the key or path and says how to fix it; the exit statuses."""

#: exit status of a run that stopped for a signal after writing its checkpoint (``EX_TEMPFAIL``: try again)
EXIT_PREEMPTED = 75


class ConfigError(ValueError):
    """Bad input the user can fix: an impossible combination, a missing dataset, a corrupt file.

    ``python -m runner`` prints ``error: <message>`` (no traceback) and exits with status 2, before any
    result file is written.
    """


def deterministic_refusal(e: BaseException) -> ConfigError | None:
    """PyTorch's refusal, under ``torch.use_deterministic_algorithms(True)`` (``trainer.deterministic=true``), of an
    operation that has no deterministic kernel on the device (a ``RuntimeError`` raised when the step first reaches
    it: on CUDA, a CNN's adaptive average pooling backward), as one ``ConfigError`` naming the operation and the
    fix; ``None`` for any other error. Which operations lack a deterministic kernel: PyTorch's
    ``torch.use_deterministic_algorithms`` page,
    https://pytorch.org/docs/stable/generated/torch.use_deterministic_algorithms.html.

    Returns:
        The ``ConfigError`` to raise in place of ``e``, or ``None`` when ``e`` is not such a refusal.
    """
    marker = " does not have a deterministic implementation"
    if not isinstance(e, RuntimeError) or marker not in str(e):
        return None
    op = str(e).split(marker)[0].split()[-1]
    return ConfigError(
        f"trainer.deterministic=true: this job's step runs {op}, which has no deterministic kernel "
        f"on this device, so no run of it can be bit-identical; use trainer.deterministic=false, or "
        f"a model without that operation"
    )


class TrainingDiverged(RuntimeError):
    """The loss or the gradients became NaN/inf (``trainer.on_nonfinite=stop``): the message names the step, the
    last finite loss and the usual fixes. ``python -m runner`` prints it and exits with status 3; no summary
    is written, so no figure of the diverged run is taken as a measurement."""


class Preempted(Exception):
    """The run stopped for a signal (SLURM preemption or time limit) after writing its checkpoint;
    ``python -m runner`` exits with ``EXIT_PREEMPTED`` (75)."""
