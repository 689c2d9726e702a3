"""The one error type of kda: every rejected call raises :class:`KDAError`.

Messages follow one shape, ``"<argument>: expected <what>, got <what>"``, so a serving engineer reading a
traceback knows which tensor of which call was wrong without opening the source.
"""

from __future__ import annotations

from typing import NoReturn


class KDAError(ValueError):
    """A call or a configuration that kda refuses, raised before anything is launched."""


def fail(argument: str, expected: str, given: object) -> NoReturn:
    """Raise :class:`KDAError` naming ``argument``, what was ``expected`` and what was ``given``."""
    raise KDAError(f"{argument}: expected {expected}, got {given}")
