"""The error surface shared by the command-line entry points (train, evaluate, generate, plot, experiments.unit_scale).

An error the user can act on (a bad flag, a gin mistake, a value out of range, a missing or unreadable file, a
checkpoint that cannot be restored) is printed as ONE line on stderr, ``<prog>: error: <what, naming the file, key
or value>``, and the process exits non-zero:

    exit 2  usage or configuration error: a bad flag (argparse), `UsageError` (gin errors and start-up validation,
            see setup.load_gin), models.ConfigError (config.json, tokenizer/model mismatch), sharding.ShardingError,
            text.PromptTooLongError (the start-up prompt check);
    exit 1  any other handled error: files (FileNotFoundError, PermissionError, other OSError), a checkpoint that
            cannot be restored, ValueError / TypeError / KeyError raised while running, the
            project's own run-time errors (e.g. NonFiniteError);
    exit 130 interrupted (Ctrl-C).

``--debug`` (every CLI has it) re-raises instead, for the full traceback. Anything else (AssertionError,
AttributeError, XLA runtime errors: bugs, or errors whose detail matters) keeps Python's traceback.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Callable, Sequence
from nlac_jax.storage import fs

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
MAX_MESSAGE_CHARS = 1000

# Usage/config error classes defined in modules that are heavy to import: matched only once their module is loaded
# (an exception of a class whose module was never imported cannot have been raised).
_USAGE_CLASSES = (("nlac_jax.models.config", "ConfigError"), ("nlac_jax.parallel.sharding", "ShardingError"),
                  ("nlac_jax.text.fitting", "PromptTooLongError"), ("nlac_jax.planning.planner", "PlanError"))


class UsageError(ValueError):
    """A bad command-line value or configuration (exit code 2); the message names the flag, key, file or value."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a `--debug` flag and one-line errors (`<prog>: error: <message>`, exit 2) instead of usage +
    message; `--help` shows the description verbatim (the CLIs' docstrings are laid out by hand)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)
        self.add_argument("--debug", action="store_true",
                          help="on an error, show the full Python traceback instead of one line")

    def error(self, message: str):
        """Print one line and exit 2 (argparse's default prints the usage block first)."""
        sys.stderr.write(f"{self.prog}: error: {' '.join(message.split())} (see --help)\n")
        sys.exit(EXIT_USAGE)


# --------------------------------------------------------------------------------------------- value checks
def _type_checker(kind: str, check: Callable[[float], bool], what: str):
    def parse(text: str):
        try:
            v = int(text) if kind == "int" else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind == 'int' else 'a number'}")
        if not check(v):
            raise argparse.ArgumentTypeError(f"{text!r} is out of range (expected {what})")
        return v
    parse.__name__ = what  # argparse names the type in some messages
    return parse


def int_at_least(lo: int):
    """argparse `type=`: an integer >= lo."""
    return _type_checker("int", lambda v: v >= lo, f"an integer >= {lo}")


def float_in(lo: float, hi: float, lo_open: bool = False):
    """argparse `type=`: a finite number in [lo, hi] ((lo, hi] with lo_open)."""
    what = f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
    return _type_checker("float", lambda v: (v > lo if lo_open else v >= lo) and v <= hi, what)


def finite_at_least(lo: float):
    """argparse `type=`: a finite number >= lo (NaN and inf refused)."""
    return _type_checker("float", lambda v: v >= lo and v != float("inf"), f"a finite number >= {lo:g}")


# --------------------------------------------------------------------------------------------- error handling
def is_usage_error(e: BaseException) -> bool:
    """Whether `e` is a usage/configuration error (exit code 2), see the module docstring."""
    if isinstance(e, UsageError):
        return True
    for module, name in _USAGE_CLASSES:
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None and isinstance(e, cls):
            return True
    return False


def is_handled(e: BaseException) -> bool:
    """Whether `e` gets the one-line treatment (the project's own errors and the common system ones)."""
    if isinstance(e, (OSError, ValueError, TypeError, KeyError, UsageError)):
        return True
    module = type(e).__module__ or ""
    return module.startswith(("nlac_jax.", "gin."))  # project errors (CheckpointRestoreError, ...) and gin's


def one_line(e: BaseException) -> str:
    """`e` as one line: the exception's type (unless the message already says what it is) and its message."""
    msg = " ".join(str(e).split())
    if isinstance(e, KeyError) and len(e.args) == 1:
        msg = f"missing key {e.args[0]!r}"
    if not msg:
        msg = "(no message)"
    if not isinstance(e, UsageError):
        msg = f"{type(e).__name__}: {msg}"
    if len(msg) > MAX_MESSAGE_CHARS:
        msg = msg[:MAX_MESSAGE_CHARS] + " ..."
    return msg


def _is_async_noise(exc_type, exc, obj=None) -> bool:
    """Leftovers of a failed orbax restore: the per-array read coroutines it abandoned, and tensorstore callbacks
    that complete after the restore closed its asyncio loop ('Event loop is closed'), reported one traceback per
    array while they are collected. The restore error (or its fallback warning) already says what went wrong."""
    if exc_type is RuntimeError and str(exc) == "Event loop is closed":
        return True
    code = getattr(obj, "cr_code", None)  # a coroutine
    return code is not None and "orbax" in code.co_filename


def _install_quiet_hooks(prog: str) -> None:
    """Warnings as one line each, and no tracebacks from the async leftovers of a failed checkpoint read."""
    old_unraisable, old_excepthook = sys.unraisablehook, sys.excepthook

    def unraisablehook(args):
        if not _is_async_noise(args.exc_type, args.exc_value, args.object):
            old_unraisable(args)

    def excepthook(exc_type, exc, tb):
        if not _is_async_noise(exc_type, exc):
            old_excepthook(exc_type, exc, tb)

    def showwarning(message, category, filename, lineno, file=None, line=None):
        stream = file if file is not None else sys.stderr
        try:
            stream.write(f"{prog}: warning: {category.__name__}: {' '.join(str(message).split())}\n")
        except OSError:  # stderr gone: nothing to report to
            pass

    # installed for the rest of the process: leftovers may be collected after main returns
    sys.unraisablehook, sys.excepthook, warnings.showwarning = unraisablehook, excepthook, showwarning


def _settle_async_work() -> None:
    """Quietly collect async work a failed call left behind (training.checkpoint.collect_orphaned_futures); nothing
    to do (and nothing heavy imported) when the checkpoint module was never loaded."""
    ckpt = sys.modules.get("nlac_jax.training.checkpoint")
    if ckpt is not None:
        ckpt.collect_orphaned_futures()


def run(main: Callable[[Sequence[str] | None], object], argv: Sequence[str] | None = None,
        prog: str = "nlac_jax") -> int:
    """Call `main(argv)` and turn a handled error into one line on stderr plus an exit code (module docstring).

    Returns the exit code (0 on success); with `--debug` in argv, errors propagate with their traceback.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    if not debug:
        _install_quiet_hooks(prog)
    try:
        rc = main(argv)
        return rc if isinstance(rc, int) and not isinstance(rc, bool) else 0  # main's own exit code (e.g. 143)
    except KeyboardInterrupt:
        if debug:
            raise
        _settle_async_work()
        sys.stderr.write(f"{prog}: interrupted\n")
        return EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001  filtered by is_handled; everything else is re-raised untouched
        if debug or not is_handled(e):
            raise
        _settle_async_work()
        usage = is_usage_error(e)
        hint = "" if usage else " (--debug: full traceback)"
        sys.stderr.write(f"{prog}: error: {one_line(e)}{hint}\n")
        sys.stderr.flush()
        return EXIT_USAGE if usage else EXIT_ERROR


def run_command(command) -> None:
    """`python -m nlac_jax.<name>`: run the command module's `main` (`cli/<name>.py`) through `run`; exit with its
    code."""
    sys.exit(run(command.main, prog=command.PROG))


def add_gin_file_flags(p: argparse.ArgumentParser, file_example: str, param_example: str | None = None) -> None:
    """--gin_file (repeatable, required) and --gin_param (repeatable): the gin flags of every gin-configured CLI.
    The examples only shape the help text."""
    p.add_argument("--gin_file", action="append", default=[], required=True, metavar="FILE",
                   help=f"gin file, e.g. {file_example} (repeatable; later files override earlier ones)")
    example = f", e.g. {param_example!r}" if param_example else ""
    p.add_argument("--gin_param", action="append", default=[], metavar="BINDING",
                   help=f"one gin binding{example} (repeatable; applied after the files)")


def require_file(path: str, flag: str) -> str:
    """`path` (local or gs://) if it is an existing file, else a UsageError naming the flag and the path."""
    if not fs.exists(path):
        raise UsageError(f"{flag} {path}: no such file")
    if not fs.isfile(path):
        raise UsageError(f"{flag} {path}: not a file")
    return path


def require_dir(path: str, flag: str) -> str:
    """`path` (local or gs://) if it is an existing directory, else a UsageError naming the flag and the path."""
    if not fs.isdir(path):
        if fs.is_remote(path) or not fs.exists(path):
            raise UsageError(f"{flag} {path}: no such directory")
        raise UsageError(f"{flag} {path}: not a directory")
    return path
