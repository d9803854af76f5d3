"""``python -m runner.torchrun [torchrun options] -m runner [overrides]``: torchrun whose exit status is 75 when the
workers stopped for a preemption (``runner.launch.torchrun``); plain ``torchrun`` exits 1 for any worker failure."""

import sys

from runner.launch import torchrun

if __name__ == "__main__":
    sys.argv[0] = "torchrun"
    sys.exit(torchrun(sys.argv[1:]))
