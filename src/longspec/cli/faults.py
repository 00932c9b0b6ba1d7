"""What the command line does with an exception: one line that names the problem and
the fix, and an exit status — never a traceback, unless asked for (`--debug` or
LONGSPEC_DEBUG=1) for a bug report."""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable

from longspec.runtime.model_cache import CacheWriteError

DEBUG_ENV = "LONGSPEC_DEBUG"

EXIT_USAGE = 2  # bad input: arguments, files, checkpoints
EXIT_FAILURE = 1  # the machine: I/O, disk, an internal error
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report Ctrl-C
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as `yes | head` reports it

# Exceptions raised for input a user can fix; the message already names the fix.
_USER_FAULTS = (ValueError, TypeError, KeyError, LookupError, FileNotFoundError, IsADirectoryError,
                NotADirectoryError, FileExistsError)


_OS_HINTS = {
    errno.ENOSPC: "the disk is full: free some space or write elsewhere (--out, LONGSPEC_CACHE)",
    errno.EDQUOT: "the disk quota is exhausted: free some space or write elsewhere (--out, LONGSPEC_CACHE)",
    errno.EACCES: "choose a path you can write (--out, LONGSPEC_CACHE) or fix its permissions",
    errno.EPERM: "choose another path or fix its permissions",
    errno.EROFS: "the file system is read-only: write elsewhere (--out, LONGSPEC_CACHE)",
}


def run_reporting_faults(command: Callable[[], int], *, debug: bool = False) -> int:
    debug = debug or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    try:
        return command()
    except KeyboardInterrupt:
        if debug:
            raise
        print("\nlongspec: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly. Point stdout at /dev/null so
        # the interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except Exception as error:  # noqa: BLE001 - the one place every fault is turned into a message
        if debug:
            raise
        status, message = describe(error)
        print(f"longspec: error: {message}", file=sys.stderr)
        return status


def describe(error: Exception) -> tuple[int, str]:
    """(exit status, one-line message) for an exception that reached the top."""
    text = str(error) or type(error).__name__
    if isinstance(error, KeyError):
        text = str(error.args[0]) if error.args else text  # KeyError's str() adds quotes
    if isinstance(error, UnicodeDecodeError):
        return EXIT_USAGE, f"input is not UTF-8 text ({error.reason} at byte {error.start}); convert it to UTF-8"
    if isinstance(error, _USER_FAULTS):
        return EXIT_USAGE, text
    if isinstance(error, OSError):
        detail = error.strerror or text
        if error.filename:
            detail += f": {error.filename}"
        hint = _OS_HINTS.get(error.errno)
        if hint and not isinstance(error, CacheWriteError):  # the cache names its own fix
            detail += f"; {hint}"
        return EXIT_FAILURE, detail
    return EXIT_FAILURE, (f"internal error: {type(error).__name__}: {text}. This is a bug in longspec: please "
                          f"report it with the traceback from `longspec --debug ...` (or {DEBUG_ENV}=1)")
