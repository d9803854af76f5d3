"""``python -m runner.doctor``: see ``runner.doctor.cli``."""

import sys

from runner.doctor.cli import main

sys.exit(main())
