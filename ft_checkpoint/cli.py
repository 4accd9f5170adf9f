"""The ``ft-checkpoint`` command line.

Example:
    $ ft-checkpoint --version
    ft-checkpoint 0.1.0
"""

from __future__ import annotations

import argparse
import sys

from ft_checkpoint import __version__


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; subcommands are added here as they arrive."""
    parser = argparse.ArgumentParser(
        prog="ft-checkpoint",
        description="Inspect and manage fault-tolerant checkpoint directories (local paths or fsspec URLs).")
    parser.add_argument("--version", action="version", version=f"ft-checkpoint {__version__}")
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
