"""The ``dynpipe`` command: a thin dispatcher over subcommand modules.

Each subcommand lives beside the code it drives, in a module exposing
``register(subparsers)`` that adds its parser and sets ``func(args) -> int``. Those modules
import only argparse-level code at import time; heavy libraries (xgboost, matplotlib,
pynvml, torch.distributed) are imported inside ``func`` so ``dynpipe --help`` stays fast.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib
import os
import select
import signal
import sys
import threading

from dynpipe.errors import UserError

__all__ = ["build_parser", "entry", "main"]


class _Terminated(BaseException):
    """SIGTERM, raised where the main thread is so that ``finally`` blocks clean up."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Terminated(signum)


# 128 + SIGPIPE (13), as a shell reports a C tool stopped by a closed pipe (`cat | head`).
_EXIT_SIGPIPE = 141

# Commands that start training workers on this node (when not themselves a worker).
_LAUNCHERS = ("train", "demo")

# Order is the order shown in --help.
_SUBCOMMANDS = (
    "dynpipe.demo.cli",
    "dynpipe.runtime.cli",
    "dynpipe.runtime.requests",
    "dynpipe.models.cli",
    "dynpipe.models.export",
    "dynpipe.planner.cli",
    "dynpipe.profiler.cli",
    "dynpipe.predictor.cli",
    "dynpipe.analysis.cli",
)


def build_parser() -> argparse.ArgumentParser:
    from dynpipe import __version__

    parser = argparse.ArgumentParser(
        prog="dynpipe",
        description="Adaptive pipeline-parallel training on GPUs shared with other jobs.",
    )
    parser.add_argument("--version", action="version", version=f"dynpipe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod_name in _SUBCOMMANDS:
        try:
            mod = importlib.import_module(mod_name)
        except ModuleNotFoundError as exc:
            if exc.name == mod_name:
                continue  # that part of dynpipe is not installed in this build
            raise
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            return _dispatch(argv)
        finally:
            # Flushed here so that a reader that closed early (`dynpipe ... | head -1`) fails
            # inside this try rather than at interpreter exit, where it would be a traceback.
            sys.stdout.flush()
    except BrokenPipeError:
        if not _stdout_lost():
            raise  # another pipe or socket (a training peer's): not ours to hide
        # Python's note on SIGPIPE: point stdout at devnull so the flush at exit succeeds,
        # and never restore SIG_DFL (that would also kill a run writing to a lost socket).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return _EXIT_SIGPIPE


def _stdout_lost() -> bool:
    """Whether standard output is a pipe whose reader has gone (poll reports an error on
    its write end)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll here, or stdout is no file
        return False


def _launches(argv: list[str]) -> bool:
    """Whether ``argv`` starts training workers from this process."""
    return (
        bool(argv)
        and argv[0] in _LAUNCHERS
        and "RANK" not in os.environ
        and not {"-h", "--help"} & set(argv)
    )


def _dispatch(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if _launches(argv):
        from dynpipe.runtime.launch import start_fork_server

        start_fork_server("dynpipe.runtime.cli")  # its imports run beside ours
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv  # subcommands that re-launch themselves (train) need the raw words
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    if threading.current_thread() is threading.main_thread():
        # One line and a clean-up on SIGTERM, like Ctrl-C (subcommands that handle signals
        # themselves, such as training workers, install their own handlers over this one).
        signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"dynpipe {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, _Terminated) as exc:
        signum = exc.signum if isinstance(exc, _Terminated) else signal.SIGINT
        # A training worker stopped before it could handle signals itself says nothing: its
        # launcher reports the stop in one line for the whole job.
        if not (args.command == "train" and "RANK" in os.environ):
            what = "terminated" if signum == signal.SIGTERM else "interrupted"
            print(f"dynpipe {args.command}: {what}", file=sys.stderr)
        return 128 + int(signum)


def entry() -> None:
    """The ``dynpipe`` program: ``main``, then exit. A process that launched workers exits
    without the interpreter's clean-up of torch's modules (1.4 s of CPU on a 2-core VM,
    while whoever reads its output waits for it); its exit handlers still run, and it
    closed every file it opened."""
    rc = main()
    if not _launches(sys.argv[1:]):
        sys.exit(rc)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(rc)


if __name__ == "__main__":
    entry()
