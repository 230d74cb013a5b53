"""What every command-line tool shares: argparse flags in snake_case, one error wrapper, the compilation cache.

Convention (``train.py``, ``infer.py``, ``python -m minimax_jax.{convert,eval,eval.recall,train.export}``):
flags are argparse, ``--snake_case``; a boolean is ``--name`` / ``--no_name`` (``add_bool``); sizes are
in MiB (``..._mb``), times in seconds (``..._s``). A renamed flag keeps a deprecated alias
(``parse_args(..., aliases=...)``) that still works and prints one warning line.

``run(main, argv, prog=...)`` calls ``main(argv)`` and turns what escapes it into an exit status of
:mod:`minimax_jax.exit_codes` with one ``PROG: error: ...`` line on stderr (``usage`` exception types
-> 2, anything else -> 1, KeyboardInterrupt -> 130); ``--debug`` prints the traceback as well.

``enable_compilation_cache(value)``: JAX's persistent compilation cache, on by default in the tools
that compile (``--compilation_cache DIR|none``, else ``$MINIMAX_JAX_CACHE``, else
``$JAX_COMPILATION_CACHE_DIR``, else ``~/.cache/minimax_jax/jax_cache``).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable, Sequence

from minimax_jax.exit_codes import FAILURE, INTERRUPTED, USAGE, UsageError

__all__ = ["Parser", "run", "add_bool", "add_common", "add_mesh", "parse_args", "int_at_least", "float_in",
           "enable_compilation_cache", "DEFAULT_CACHE", "CACHE_ENV", "SEED_MAX"]

#: Where the persistent compilation cache lives unless told otherwise.
DEFAULT_CACHE = os.path.join("~", ".cache", "minimax_jax", "jax_cache")
CACHE_ENV = "MINIMAX_JAX_CACHE"
#: Programs that compile faster than this are not cached (JAX's default, 1 s, misses most small ones).
CACHE_MIN_COMPILE_S = 0.2
#: Largest ``--seed``: the RNGs take 32-bit unsigned seeds.
SEED_MAX = 2 ** 32 - 1
#: Errors that are the user's: exit status 2 by default.
USAGE_ERRORS = (UsageError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


class Parser(argparse.ArgumentParser):
    """argparse with a one-line usage error (``PROG: error: ... (see --help)``, exit status 2)."""

    def error(self, message: str):
        self.exit(USAGE, f"{self.prog}: error: {message} (see --help)\n")


def _one_line(e: BaseException) -> str:
    text = "; ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__
    return text if len(text) <= 2000 else text[:2000] + " ..."


def run(main: Callable[[list[str]], int | None], argv: Sequence[str] | None = None, *, prog: str,
        usage: tuple[type[BaseException], ...] = (), failure: tuple[type[BaseException], ...] = (),
        hard_interrupt: bool = False) -> int:
    """``main(argv)`` (argv default ``sys.argv[1:]``) -> exit status (see module docstring).

    ``usage`` / ``failure``: extra exception types reported as exit status 2 / 1 (the class nearest to
    the error's own in its MRO decides; an unlisted error is 1).
    ``hard_interrupt``: on Ctrl-C end the process with ``os._exit`` (no teardown while XLA threads run).
    SystemExit (argparse's usage errors: status 2) passes through.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        code = main(argv)
        return 0 if code is None else int(code)
    except KeyboardInterrupt:
        sys.stdout.flush()
        print(f"{prog}: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
        if hard_interrupt:
            os._exit(INTERRUPTED)
        return INTERRUPTED
    except Exception as e:  # noqa: BLE001 - every error ends as one line (the traceback with --debug)
        if debug:
            traceback.print_exc()
        kind = next((k for c in type(e).__mro__ for k, group in ((USAGE, USAGE_ERRORS + usage), (FAILURE, failure))
                     if c in group), None)    # the most specific listed class decides
        hint = "" if kind is not None or debug else f" ({type(e).__name__}; --debug shows the traceback)"
        print(f"{prog}: error: {_one_line(e)}{hint}", file=sys.stderr, flush=True)
        return FAILURE if kind is None else kind


class _Bool(argparse.Action):
    """``--name`` sets True, ``--no_name`` sets False."""

    def __init__(self, option_strings, dest, default=None, required=False, help=None):
        super().__init__(option_strings, dest, nargs=0, default=default, required=required, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, not option_string.startswith("--no_"))


def add_bool(p: argparse.ArgumentParser, name: str, default: bool | None, help: str,
             absl_alias: bool = False) -> None:
    """``--name`` / ``--no_name``; ``absl_alias``: also the deprecated absl spelling ``--noname``."""
    p.add_argument(f"--{name}", f"--no_{name}", dest=name, action=_Bool, default=default,
                   help=f"{help} (default: {'on' if default else 'off'})" if default is not None else help)
    if absl_alias:
        aliases(p)[f"--no{name}"] = (f"--no_{name}", None)


def aliases(p: argparse.ArgumentParser) -> dict:
    """The parser's deprecated flags: ``{old: (new, convert value or None)}``."""
    if not hasattr(p, "_deprecated"):
        p._deprecated = {}
    return p._deprecated


def add_common(p: argparse.ArgumentParser, cache: bool = False) -> argparse.ArgumentParser:
    """``--debug`` (tracebacks) and, for tools that compile, ``--compilation_cache``."""
    p.add_argument("--debug", action="store_true", help="print the traceback of an error (default: one line)")
    if cache:
        p.add_argument("--compilation_cache", default=None, metavar="DIR|none",
                       help=f"JAX persistent compilation cache folder, or 'none' (default: ${CACHE_ENV}, else "
                            f"$JAX_COMPILATION_CACHE_DIR, else {DEFAULT_CACHE})")
    return p


def add_mesh(p: argparse.ArgumentParser) -> None:
    """``--mesh`` and ``--sharding_rules`` of the inference tools (``infer.py``, the server)."""
    p.add_argument("--mesh", default=None, help="Device mesh, e.g. 'tensor=4' or 'fsdp=2,tensor=2' (axes data, "
                                                "fsdp, expert, sequence, tensor; one may be -1): parameters loaded "
                                                "sharded by --sharding_rules, the paged engine's KV cache sharded by "
                                                "kv head over tensor, each prefill chunk split over a sequence axis "
                                                "(context parallelism).")
    p.add_argument("--sharding_rules", default=None, help="Sharding rule preset (configs/sharding.yaml) or a YAML "
                                                          "path (default: default); needs --mesh.")


def parse_args(p: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``p.parse_args`` after rewriting the parser's deprecated flags (one warning line each)."""
    table, out, warned = aliases(p), [], set()
    args = list(sys.argv[1:] if argv is None else argv)
    i = 0
    while i < len(args):
        a = args[i]
        name, eq, value = a.partition("=")
        if name in table:
            new, convert = table[name]
            if name not in warned:
                warned.add(name)
                unit = " (the value converted)" if convert else ""
                print(f"{p.prog}: warning: {name} is deprecated; use {new}{unit}", file=sys.stderr)
            if convert is not None:
                if not eq and i + 1 < len(args):
                    i, value = i + 1, args[i + 1]
                try:
                    value = repr(convert(value))
                except ValueError:
                    pass    # the new flag's parser reports it
                out.append(f"{new}={value}")
            else:
                out.append(new + (eq + value if eq else ""))
        else:
            out.append(a)
        i += 1
    return p.parse_args(out)


def int_at_least(lo: int, hi: int | None = None):
    """argparse type: an integer >= ``lo`` (and <= ``hi`` when given)."""
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"must be >= {lo}" + (f" and <= {hi}" if hi is not None else "")
                                             + f", got {v}")
        return v
    parse.__name__ = f"integer >= {lo}" + (f" <= {hi}" if hi is not None else "")
    return parse


def float_in(lo: float | None = None, hi: float | None = None):
    """argparse type: a finite number in ``[lo, hi]``."""
    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
        if v != v or v in (float("inf"), float("-inf")) or (lo is not None and v < lo) or (hi is not None and v > hi):
            rng = " and ".join(x for x in (lo is not None and f">= {lo}", hi is not None and f"<= {hi}") if x)
            raise argparse.ArgumentTypeError(f"must be a finite number{' ' + rng if rng else ''}, got {s}")
        return v
    parse.__name__ = "number"
    return parse


_CACHE_SHOWN: list[str | None] = []


def enable_compilation_cache(value: str | None, *, prog: str = "minimax_jax",
                             min_compile_s: float = CACHE_MIN_COMPILE_S) -> str | None:
    """Turn JAX's persistent compilation cache on (see module docstring); returns its folder or None.

    ``value``: a folder, ``none`` (off) or None (the environment / default). Prints the folder once per
    process on stderr. Raises UsageError when the folder cannot be created.
    """
    import jax

    value = value or os.environ.get(CACHE_ENV) or os.environ.get("JAX_COMPILATION_CACHE_DIR") or DEFAULT_CACHE
    if value.lower() in ("none", "off", "0", ""):
        folder = None
    else:
        folder = os.path.abspath(os.path.expanduser(value))
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            raise UsageError(f"--compilation_cache {value}: cannot create the folder ({e.strerror}); "
                             "pass another folder or 'none'") from None
        jax.config.update("jax_compilation_cache_dir", folder)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_s)
    if not _CACHE_SHOWN:
        _CACHE_SHOWN.append(folder)
        print(f"{prog}: compilation cache: {folder or 'off'} (--compilation_cache DIR|none)", file=sys.stderr)
    return folder
