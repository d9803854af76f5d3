"""``python -m runner.tune <tuner> [--out DIR] [overrides of python -m runner]``: compose the run config with
Hydra as ``python -m runner`` does and run one tuner of ``runner.tune.TUNERS`` (also under torchrun:
``torchrun ... -m runner.tune batch_size distributed=ddp ...``)."""

from __future__ import annotations

import shlex
import sys
import time

import hydra
from omegaconf import DictConfig

import runner
from runner import CONF_DIR
from runner.errors import ConfigError
from runner.tune import TUNERS, run


def usage() -> str:
    """The ``--help`` text: the command line, each tuner of ``TUNERS`` with its help, the outputs, an example."""
    names = ",".join(TUNERS)
    lines = [f"usage: python -m runner.tune {{{names}}} [--out DIR] [overrides of python -m runner]", ""]
    for name, tuner in TUNERS.items():
        first, *rest = tuner.help.splitlines()
        lines += [f"  {name:<12} {first}", *(" " * 15 + line for line in rest)]
    lines += [
        "",
        "Outputs: outputs/tune/<tuner>/<date>_<time>/ (or --out DIR): <tuner>.csv, .md, .png, .json.",
        "Example: python -m runner.tune batch_size model=resnet18 data=cifar10 data.root=/path logger=none",
    ]
    return "\n".join(lines)


_KIND: list[str] = []  # the tuner named on the command line, for the Hydra task below


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    from runner.track import job_folder

    try:
        run(_KIND[0], cfg, job_folder(), started_s=runner.STARTED_S)  # the budget counts the whole command
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # Ctrl-C: a round's jobs were stopped and its interleave.json kept
        print(f"error: interrupted: the tuner stopped; what it measured is in {job_folder()}", file=sys.stderr)
        sys.exit(130)


def parse_args(args: list[str]) -> tuple[str, str | None, list[str]]:
    """``(tuner, --out DIR or None, the rest for Hydra)`` from the command line after ``python -m runner.tune``.

    Raises:
        ConfigError: no or an unknown tuner, ``--out`` without a folder, a multirun (``-m``).
    """
    if args and args[0] not in TUNERS and (named := [a for a in args if a in TUNERS]):
        reordered = " ".join(shlex.quote(a) for a in [named[0], *(a for a in args if a != named[0])])
        raise ConfigError(
            f"the tuner's name comes first, before {args[0]} and every override: python -m runner.tune {reordered}"
        )
    if not args or args[0] not in TUNERS:
        given = f"unknown tuner {args[0]!r}" if args else "no tuner named"
        raise ConfigError(
            f"{given}: use one of {', '.join(TUNERS)}, e.g. python -m runner.tune batch_size "
            f"[overrides] (python -m runner.tune --help)"
        )
    kind, rest, out = args[0], [], None
    i = 1
    while i < len(args):
        a = args[i]
        if a == "--out" or a.startswith("--out="):
            out = a.split("=", 1)[1] if "=" in a else (args[i + 1] if i + 1 < len(args) else "")
            i += 1 if "=" in a else 2
            if not out:
                raise ConfigError("--out needs a folder: python -m runner.tune <tuner> --out DIR [overrides]")
            continue
        if a in ("-m", "--multirun"):
            raise ConfigError("a tuner measures one configuration: drop -m/--multirun (sweep the result instead)")
        rest.append(a)
        i += 1
    return kind, out, rest


def main() -> None:
    """``python -m runner.tune <tuner> [--out DIR] [overrides]``: exit status 2 with one ``error:`` line for bad
    input. Under torchrun, ranks > 0 are kept out of the output folder as in ``python -m runner``."""
    from runner.launch import prepare_process, record_if_elastic

    if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help"):
        print(usage())
        return
    try:
        kind, out, rest = parse_args(sys.argv[1:])
        sys.argv[1:] = rest + ([f"hydra.run.dir={out}"] if out else [])
        layout = prepare_process(sys.argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if layout.rank == 0 and not any(a.startswith("hydra.run.dir=") for a in sys.argv):
        sys.argv.append(f"hydra.run.dir=outputs/tune/{kind}/{time.strftime('%Y-%m-%d_%H-%M-%S')}")
    _KIND[:] = [kind]
    record_if_elastic(_hydra_main)()


if __name__ == "__main__":
    main()
