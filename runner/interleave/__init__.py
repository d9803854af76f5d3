"""Interleaved, paired measurement of a sweep (``python -m runner -m hydra/launcher=interleaved <sweep>``).

- ``launcher``: the Hydra launcher; prepares each job's folder and config, adds the reference's copy (A').
- ``coordinator``: the conductor; resident job processes take turns in slices, in groups that fit in memory.
- ``schedule``: the order of a pass (R J J R, reversed every other pass) and which slices pair up.
- ``stats``: paired t on log ratios, Holm's step-down verdicts, the minimum detectable effect.
- ``record``: ``interleave.json``, written after every pass, and the comparisons it supports.

The job side is the engine's pause point, runner/slice_gate.py; the reports read the record through
runner/report/paired.py.
"""
