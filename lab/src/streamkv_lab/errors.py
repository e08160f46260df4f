"""The lab's one usage-error type (torch-free: the CLI imports it to build its parser).

A :class:`UsageError` says that what the user asked for cannot run as asked: a bad value, a bad
file, an option that does not apply to what the command runs. The ``streamkv`` command prints it
as one line on stderr and exits with status 2, before any work. Every other exception is a bug
(of the lab or the library) and keeps its traceback (exit status 1): the CLI never disguises one
as the user's mistake.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["UsageError", "usage_errors"]


class UsageError(ValueError):
    """A refusal of the user's input, raised before any work (one line, exit status 2).

    A ``ValueError`` so that callers of a command's ``check`` from Python that catch
    ``ValueError`` keep working."""


@contextmanager
def usage_errors(*types: type[Exception], what: str | None = None) -> Iterator[None]:
    """Inside: a library call made with the user's values, whose ``types`` (default
    ``ValueError``) name the bad value; re-raised as :class:`UsageError` with the same message
    (``what:`` in front when given, e.g. the option). Put it around that one call only: the same
    exception from anywhere else is a bug and must keep its traceback."""
    types = types or (ValueError,)
    try:
        yield
    except UsageError:
        raise
    except types as exc:
        message = str(exc) if what is None else f"{what}: {exc}"
        raise UsageError(message) from exc
