"""The one exception type for bad input: it names the key or path and says how to fix it."""


class ConfigError(ValueError):
    """Bad input the user can fix: an impossible combination, a missing dataset, a corrupt file.

    ``python -m runner`` prints ``error: <message>`` (no traceback) and exits with status 2, before any
    result file is written.
    """


class TrainingDiverged(RuntimeError):
    """The loss or the gradients became NaN/inf (``trainer.on_nonfinite=stop``): the message names the step, the
    last finite loss and the usual fixes. ``python -m runner`` prints it and exits with status 3; no summary
    is written, so no figure of the diverged run is taken as a measurement."""


class Preempted(Exception):
    """The run stopped for a signal (SLURM preemption or time limit) after writing its checkpoint;
    ``python -m runner`` exits with ``runner.preempt.EXIT_PREEMPTED`` (75)."""
