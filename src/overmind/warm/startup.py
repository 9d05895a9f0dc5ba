"""What CPython decides at start from its options and environment, redone for a forked run:
start-up flags, the locale (PEP 538 coercion), UTF-8 mode and the standard streams.

Used by ``overmind.warm.script`` in the child of a warm interpreter, which started under another
environment than the run's::

    utf8, ctype = apply_locale(env)
    install_stdio(env, utf8, ctype, keep=old_streams)
    run_flag("B", "PYTHONDONTWRITEBYTECODE", env)
"""

from __future__ import annotations

import codecs
import io
import locale
import os
import sys

__all__ = ["pyenv", "interpreter_options", "run_flag", "apply_locale", "install_stdio", "C_LOCALE_WARNING"]

COERCION_TARGETS = ("C.UTF-8", "C.utf8", "UTF-8")  # PEP 538, in CPython's order
COERCION_WARNING = ("Python detected LC_CTYPE=C: LC_CTYPE coerced to {} (set another locale "
                    "or PYTHONCOERCECLOCALE=0 to disable this locale coercion behavior).\n")
C_LOCALE_WARNING = ("Python runtime initialized with LC_CTYPE=C (a locale with default ASCII "
                    "encoding), which may cause Unicode compatibility problems. Using C.UTF-8, "
                    "C.utf8, or UTF-8 (if available) as alternative Unicode-compatible locales is "
                    "recommended.\n")


def pyenv(env: dict[str, str], name: str) -> str | None:
    """A PYTHON* variable as CPython reads it: ignored under -E/-I, empty means unset."""
    return None if sys.flags.ignore_environment else env.get(name) or None


def interpreter_options() -> list[str]:
    """The warm interpreter's own interpreter options: what comes before its ``-c CODE``."""
    argv = sys.orig_argv
    return argv[1:argv.index("-c")] if "-c" in argv[1:] else []


def run_flag(letters: str, name: str, env: dict[str, str], options: tuple = ()) -> bool:
    """A start-up option of this run: given on the warm interpreter's command line or the run's own
    (``options``, RunSpec.options), as one of ``letters`` (-u, -B, -P, -I), or set by ``name`` in the
    run's environment. The warm interpreter's environment set sys.flags too, but it was the warm
    interpreter's, not the run's."""
    given = set()
    for option in [*interpreter_options(), *options]:
        if option[:1] == "-" and option[:2] != "--":
            given.update(option[1:].split("W")[0].split("X")[0])  # a -W/-X value holds no flags
    return bool(given & set(letters)) or bool(pyenv(env, name))


def apply_locale(env: dict[str, str]) -> tuple[bool, str]:
    """LC_CTYPE from the run's environment as CPython sets it at start, PEP 538 coercion
    included. Returns (UTF-8 mode for stdio, the LC_CTYPE locale)."""
    try:
        locale.setlocale(locale.LC_CTYPE, "")
    except locale.Error:
        locale.setlocale(locale.LC_CTYPE, "C")  # where a fresh process starts
    ctype = locale.setlocale(locale.LC_CTYPE)
    utf8 = _utf8_mode(env, ctype)
    coerce = pyenv(env, "PYTHONCOERCECLOCALE")
    if ctype == "C" and coerce != "0" and not env.get("LC_ALL"):
        for target in COERCION_TARGETS:
            try:
                locale.setlocale(locale.LC_CTYPE, target)
            except locale.Error:
                continue
            if locale.nl_langinfo(locale.CODESET):
                os.environ["LC_CTYPE"] = target  # exported to children, as CPython does
                if coerce == "warn":
                    os.write(2, COERCION_WARNING.format(target).encode())
                break
        else:
            locale.setlocale(locale.LC_CTYPE, ctype)
    return utf8, locale.setlocale(locale.LC_CTYPE)


def _utf8_mode(env: dict[str, str], ctype: str) -> bool:
    option = sys._xoptions.get("utf8")
    value = pyenv(env, "PYTHONUTF8") if option is None else ("1" if option is True else option)
    if value is not None:
        if value not in ("0", "1"):
            # A plain python refuses to start: so does the cold start, in its own words.
            raise ValueError(f"invalid UTF-8 mode {value!r}")
        return value == "1"
    return ctype in ("C", "POSIX")


def _stdio_encoding(env: dict[str, str], utf8: bool, ctype: str) -> tuple[str, str]:
    encoding = errors = None
    if configured := pyenv(env, "PYTHONIOENCODING"):
        name, _, handler = configured.partition(":")
        if name:
            encoding, errors = name, handler or "strict"  # PYTHONIOENCODING=latin1 is strict
        elif handler:
            errors = handler
    if encoding is None:
        encoding = "utf-8" if utf8 else locale.nl_langinfo(locale.CODESET) or "utf-8"
    encoding = codecs.lookup(encoding).name  # LookupError: a plain python would not start
    if errors is None:
        legacy = ctype in ("C", "POSIX", *COERCION_TARGETS)
        errors = "surrogateescape" if utf8 or legacy else "strict"
    return encoding, errors


def install_stdio(env: dict[str, str], utf8: bool, ctype: str, keep: list, options: tuple = ()) -> None:
    """New sys.std* over fds 0-2 as CPython would make them for this environment; the old ones
    go to ``keep`` (Note [Warm interpreter stdio is never flushed in the child] in overmind.warm.script)."""
    keep.extend([sys.stdin, sys.stdout, sys.stderr, sys.__stdin__, sys.__stdout__,
                            sys.__stderr__])
    encoding, errors = _stdio_encoding(env, utf8, ctype)
    unbuffered = run_flag("u", "PYTHONUNBUFFERED", env, options)
    sys.stdin = sys.__stdin__ = _create_stdio(0, "<stdin>", encoding, errors, unbuffered)
    sys.stdout = sys.__stdout__ = _create_stdio(1, "<stdout>", encoding, errors, unbuffered)
    sys.stderr = sys.__stderr__ = _create_stdio(2, "<stderr>", encoding, "backslashreplace", unbuffered)


def _create_stdio(fd: int, name: str, encoding: str, errors: str, unbuffered: bool) -> io.TextIOWrapper:
    """The calls of CPython's create_stdio() (Python/pylifecycle.c)."""
    write = fd != 0
    buffering = 0 if unbuffered and write else -1  # TextIOWrapper reads through a buffer
    buf = io.open(fd, "wb" if write else "rb", buffering, closefd=False)
    raw = buf.raw if buffering else buf
    raw.name = name
    stream = io.TextIOWrapper(buf, encoding, errors, newline="\n", write_through=unbuffered,
                              line_buffering=not unbuffered and (raw.isatty() or fd == 2))
    stream.mode = "w" if write else "r"
    return stream
