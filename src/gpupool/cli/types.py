"""What every ``gpupool`` command is: a :class:`CLISubcommand` (vLLM's ``entrypoints/cli/types.py``),
and the one error a command raises to stop (:class:`CLIError`)."""
from __future__ import annotations

import argparse


class CLIError(Exception):
    """A user-facing error: printed as ``gpupool: error: ...`` with exit status ``code``."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


class CLISubcommand:
    """One command of ``gpupool``: its parser (its texts as class attributes, its options in
    :meth:`add_arguments`), its checks, the device its kernels need, its run.

    ``gpupool.cli.main`` calls, in order, :meth:`validate` (before any work), :meth:`kernel_device`
    (the run re-executes itself when that device needs the other Triton backend) and :meth:`cmd`.
    """

    name: str
    help: str  # its line in ``gpupool --help``
    description: str  # the first paragraph of ``gpupool NAME --help``
    epilog: str | None = None  # the last one

    def subparser_init(self, subparsers) -> argparse.ArgumentParser:
        """Add this command's parser to ``subparsers`` (``add_subparsers()``'s action) and return it."""
        parser = subparsers.add_parser(self.name, help=self.help, description=self.description, epilog=self.epilog)
        self.add_arguments(parser)
        return parser

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """The command's arguments and options."""
        raise NotImplementedError

    def validate(self, args: argparse.Namespace) -> None:
        """Check ``args`` before any work; CLIError (exit 2) for a combination that cannot run."""

    def kernel_device(self, args: argparse.Namespace) -> str | None:
        """The torch device (``cpu`` or ``cuda[:N]``) the command's kernels run on, None without kernels."""
        return None

    def cmd(self, args: argparse.Namespace) -> int:
        """Run the command; returns the exit status."""
        raise NotImplementedError
