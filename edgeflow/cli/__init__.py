"""The ``edgeflow`` command line. Each subcommand lives in its own module of
this package exposing ``register(subparsers)``; :mod:`edgeflow.cli.main`
discovers them, so adding a command never touches the others."""
