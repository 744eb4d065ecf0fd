"""The ``gpupool`` command's entry point: the parser assembled from the commands (each a
:class:`~gpupool.cli.types.CLISubcommand` of its own module, as vLLM's ``entrypoints/cli``), the
exit statuses, the re-execution that switches the kernels' backend, and a closed stdout pipe.

The arguments are parsed before torch or triton is imported (a usage error takes a fraction of a
second); the commands import them when they run."""
from __future__ import annotations

import argparse
import contextlib
import errno
import os
import select
import signal
import stat
import sys
import threading

from . import bench, replay
from .machine import version_text
from .types import CLIError, CLISubcommand

CMD_MODULES = (replay, bench)  # each has cmd_init() -> [CLISubcommand]; the order of `gpupool --help`
_REEXEC_ENV = "GPUPOOL_CLI_REEXEC"  # set on the one re-exec that switches the kernels' backend
# a write that the file system refused (``gpupool replay > /dev/full``, a full disk or quota): the
# command's own files are checked where they are opened, so these come from stdout
_WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO)


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (``gpupool: error: ...``, exit 2) instead of usage + message."""

    def error(self, message):
        self.exit(2, f"gpupool: error: {message} (see '{self.prog} --help')\n")


class _VersionAction(argparse.Action):
    """``--version``: argparse's, with the versions read only when it is given (they import torch)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest, nargs=0, default=default,
                         help=help or "print the versions of gpupool, torch, triton and Python, and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())  # on stdout, as argparse's own version action
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """The ``gpupool`` parser; a parsed command's :class:`CLISubcommand` is ``args.subcommand``."""
    p = _Parser(prog="gpupool", description="A KV-cache block pool whose bookkeeping lives on the GPU "
                                            "(docs: docs/semantics.md, docs/design.md, docs/errors.md).")
    p.add_argument("--version", action=_VersionAction)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in CMD_MODULES:
        for cmd in module.cmd_init():
            cmd.subparser_init(sub).set_defaults(subcommand=cmd)
    return p


def _ensure_backend(device: str, argv: list[str] | None) -> None:
    """Make the kernels run where ``device`` needs them: Triton's interpreter for ``cpu``, compiled for
    CUDA. Triton fixes that when ``gpupool`` is imported (``TRITON_INTERPRET``), so a command-line run
    that needs the other backend re-executes itself once with the variable set."""
    from .. import _backend

    want_interp = device == "cpu"
    if want_interp == _backend.interpreted():
        return
    value = "1" if want_interp else "0"
    if argv is not None or os.environ.get(_REEXEC_ENV):
        raise CLIError(f"--device {device} needs TRITON_INTERPRET={value}, but gpupool was imported with the "
                       f"kernels set up for {'the GPU' if want_interp else 'the interpreter'}; "
                       f"run the command with TRITON_INTERPRET={value}")
    sys.stdout.flush()
    sys.stderr.flush()
    env = dict(os.environ, TRITON_INTERPRET=value, **{_REEXEC_ENV: "1"})
    os.execve(sys.executable, [sys.executable, "-m", "gpupool", *sys.argv[1:]], env)


def _run(cmd: CLISubcommand, args: argparse.Namespace, argv: list[str] | None) -> int:
    cmd.validate(args)
    device = cmd.kernel_device(args)
    if device is not None:
        _ensure_backend(device, argv)
    return cmd.cmd(args)


class _PipeWatch:
    """While a command works, a thread that notices when stdout is a pipe whose reader has gone
    (``gpupool replay | head -1``) and interrupts the main thread at once, instead of at its next write
    minutes later. Linux reports a pipe's write end whose reader has gone as POLLERR to ``poll``; where
    a system does not, the command stops at its next write. The interrupt is repeated every
    ``REPEAT_S`` seconds until the command stops: C code that tests an attribute (``PyObject_HasAttr``)
    clears whatever exception is raised meanwhile, a KeyboardInterrupt too."""

    REPEAT_S = 0.2

    def __init__(self):
        self.closed = False
        self._stopping = False
        self._armed = threading.Event()  # set once __enter__ is done: no interrupt lands inside it
        self._wake = None
        self._ignored_sigint = None  # SIGINT's disposition when it was SIG_IGN (restored by stop)

    def __enter__(self):
        try:
            fd = sys.stdout.fileno()
            if not stat.S_ISFIFO(os.fstat(fd).st_mode) or not hasattr(select, "poll"):
                return self
        except (OSError, ValueError, AttributeError):  # no real stdout (a test's capture, closed)
            return self
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN and threading.current_thread() is threading.main_thread():
            # SIGINT ignored (a background job of a shell, nohup): interrupt_main would do nothing; Ctrl-C stays
            # ignored, the watch's own interrupt goes through
            self._ignored_sigint = signal.signal(signal.SIGINT, self._on_sigint)
        self._wake = os.pipe()
        self._thread = threading.Thread(target=self._watch, args=(fd,), daemon=True, name="gpupool-stdout-watch")
        self._thread.start()
        try:
            self._armed.set()
            return self
        except KeyboardInterrupt:  # the first interrupt, sent as __enter__ ended: no __exit__ will stop it
            self.stop()
            raise

    def _watch(self, fd: int) -> None:
        import _thread

        poller = select.poll()
        poller.register(fd, 0)  # no events asked for: poll wakes only for POLLERR / POLLHUP
        poller.register(self._wake[0], select.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self._wake[0] in ready:
                return
            if ready.get(fd, 0) & (select.POLLERR | select.POLLHUP):
                self.closed = True
                poller.unregister(fd)
                self._armed.wait()
                while not self._stopping:  # a KeyboardInterrupt in the main thread, told apart by ``closed``
                    _thread.interrupt_main()
                    if poller.poll(self.REPEAT_S * 1000):
                        return
                return

    def _on_sigint(self, signum, frame) -> None:
        if self.closed:  # the watch's interrupt (a real SIGINT stays ignored, as the caller asked)
            raise KeyboardInterrupt

    def stop(self) -> None:
        """End the watch: no interrupt comes after this returns (idempotent)."""
        if self._wake is None:
            return
        self._stopping = True
        self._armed.set()
        while True:
            try:
                os.write(self._wake[1], b"x")
                self._thread.join()  # after this no interrupt can come
                break
            except KeyboardInterrupt:  # a repeated one, sent before the watch saw it stop
                continue
        for f in self._wake:
            os.close(f)
        self._wake = None
        if self._ignored_sigint is not None:
            signal.signal(signal.SIGINT, self._ignored_sigint)

    def __exit__(self, *exc):
        self.stop()
        return False


def _text_streams_never_fail_on_encoding() -> None:
    """A trace's file name is printed as given; on Linux one that is not UTF-8 holds surrogates, which a
    stream with strict errors (``PYTHONIOENCODING=utf-8``, some locales) cannot write: show them escaped."""
    for stream in (sys.stdout, sys.stderr):
        if getattr(stream, "errors", None) == "strict" and hasattr(stream, "reconfigure"):
            with contextlib.suppress(ValueError, OSError):
                stream.reconfigure(errors="backslashreplace")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``gpupool`` command; returns the exit status (argparse errors exit 2)."""
    args = build_parser().parse_args(argv)
    _text_streams_never_fail_on_encoding()
    watch = _PipeWatch()
    try:
        with watch:
            return _run(args.subcommand, args, argv)
    except CLIError as e:
        print(f"gpupool: error: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        watch.stop()  # where the interrupt came before the with block: no second one after this
        if watch.closed:  # the reader of stdout went away: as a BrokenPipeError below
            _stdout_to_devnull()
            return 128 + 13
        print("gpupool: error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader of stdout went away (``gpupool replay | head -1``): stop quietly, as cat or yes do,
        # with the shell's status for SIGPIPE; stdout goes to /dev/null so the exit's flush cannot fail
        _stdout_to_devnull()
        return 128 + 13
    except OSError as e:
        if e.errno not in _WRITE_ERRNOS:
            raise
        _stdout_to_devnull()
        print(f"gpupool: error: cannot write the output: {e.strerror}", file=sys.stderr)
        return 2


def _stdout_to_devnull() -> None:
    """Point stdout at /dev/null, so the interpreter's flush at exit cannot fail a second time."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
