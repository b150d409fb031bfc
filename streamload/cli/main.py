"""Running a ``streamload`` command: its errors as one line, a closed output as a quiet exit.

Errors of the :class:`~streamload.StreamloadError` family print one line and exit 2, and so
do errors of the environment (``OSError``: a full disk, a missing permission) and
``MemoryError``. A closed standard output (``streamload info DS | head -1``) ends the command
quietly with status 141 (128 + SIGPIPE, what a shell reports for a Unix tool that SIGPIPE
stopped), no traceback; whatever it still writes goes to ``/dev/null``.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from .._errors import ConversionInterrupted, StreamloadError
from .output import SafeFormatter, say
from .parser import build_parser, cli_spelling, subparser

__all__ = ["EXIT_CLOSED_OUTPUT", "main"]

#: Exit status when the reader of the standard output went away: 128 + SIGPIPE, as shells report ``yes | head``.
EXIT_CLOSED_OUTPUT = 141


#: Options and arguments that name a file or folder, by ``dest``: an empty one is refused (``''`` would
#: name the root: ``info ''`` read ``/index.json``).
_PATH_DESTS = ("dataset", "src", "dst", "directory", "dir", "out", "output", "cache_dir", "plot")


def _empty_path(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
    """The error for an argument that names a file or folder by the empty string, else ``None``."""
    sub = subparser(parser, args.command)
    for action in sub._actions:
        if action.dest in _PATH_DESTS and getattr(args, action.dest, None) == "":
            name = "/".join(action.option_strings) or action.metavar or action.dest
            return f"argument {name}: an empty path names no file or folder"
    return None


def _reader_gone(stream: Any) -> bool:
    """Whether ``stream`` is a pipe or socket whose reading end was closed (``| head`` exited)."""
    import select

    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    if not hasattr(select, "poll"):  # pragma: no cover - not a Unix
        return True
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    try:
        return any(events & (select.POLLERR | select.POLLHUP) for _fd, events in poller.poll(0))
    except OSError:  # pragma: no cover
        return False


def _to_devnull(stream: Any) -> None:
    """Point ``stream``'s descriptor at ``/dev/null``: what is still written or flushed (at exit too) is dropped."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, stream.fileno())
    finally:
        os.close(devnull)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status.

    A closed standard output (its reader exited, as ``head`` does) ends the command with
    :data:`EXIT_CLOSED_OUTPUT` and no traceback, as the Python documentation recommends
    for ``SIGPIPE``: the rest of the output is sent to ``/dev/null``.
    """
    try:
        try:
            return _main(argv)
        except SystemExit as exc:  # --help and --version: argparse itself drops a failed write
            if exc.code == 0 and _reader_gone(sys.stdout):
                raise BrokenPipeError(errno.EPIPE, "the standard output was closed") from None
            raise
        finally:
            sys.stdout.flush()  # a closed pipe shows here, not at exit as "Exception ignored"
    except BrokenPipeError as exc:
        gone = [stream for stream in (sys.stdout, sys.stderr) if _reader_gone(stream)]
        if not gone:  # another pipe or socket broke, not ours
            say(f"streamload: error: {exc}", file=sys.stderr)
            return 2
        for stream in gone:
            _to_devnull(stream)
        return EXIT_CLOSED_OUTPUT
    except OSError as exc:  # the standard output cannot take what was written (`> /dev/full`)
        try:
            _to_devnull(sys.stdout)  # else Python's flush at exit fails again, with a traceback
        except (AttributeError, OSError, ValueError):
            pass
        say(f"streamload: error: cannot write the standard output: {exc.strerror or exc}", file=sys.stderr)
        return 2


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # argparse would blame the top-level parser; the subcommand's usage is the useful one
        subparser(parser, args.command).error(f"unrecognized arguments: {' '.join(unknown)}")
    empty = _empty_path(parser, args)
    if empty is not None:
        say(f"streamload {args.command}: error: {empty}", file=sys.stderr)
        return 2
    func: Callable[[argparse.Namespace], int] = args.func
    logger = logging.getLogger("streamload")
    handler = None
    if not logger.handlers and not logging.getLogger().handlers:
        # Without one, Python's last-resort handler prints warnings raw.
        handler = logging.StreamHandler(sys.stderr)
        handler.setLevel(logging.WARNING)
        handler.setFormatter(SafeFormatter("%(message)s"))
        logger.addHandler(handler)
    try:
        return func(args)
    except ConversionInterrupted as exc:
        say(f"streamload {args.command}: {exc}", file=sys.stderr)
        return 130
    except StreamloadError as exc:  # the library's message, its options spelled as this command's
        say(
            f"streamload {args.command}: error: {cli_spelling(str(exc), subparser(parser, args.command))}",
            file=sys.stderr,
        )
        return 2
    except BrokenPipeError:
        raise  # main() tells a closed stdout from another broken pipe
    except OSError as exc:  # the environment (disk, permissions, process limits): one line, no traceback
        say(f"streamload {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except MemoryError as exc:
        say(f"streamload {args.command}: error: out of memory {exc}".rstrip(), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        say(f"streamload {args.command}: interrupted", file=sys.stderr)
        return 130
    finally:
        if handler is not None:
            logger.removeHandler(handler)
