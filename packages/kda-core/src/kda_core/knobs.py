"""Environment knobs of kda, each declared once here.

Code reads a knob only through :func:`get`, which parses and validates the environment value at call time, so a
bad value fails with a message naming the knob and its allowed values. ``python -m kda_core.knobs`` prints the
table.

:func:`get` sits on the eager T=1 hot path (the facade reads ``KDA_T1_FAST_PATH``, the launcher
``KDA_DECODE_TILE_V``, on every call), where ``os.environ.get`` costs 0.2-0.5 us: it encodes the key, and raises and
catches a KeyError inside when the variable is unset. On POSIX ``os.environ`` keeps the raw bytes in a plain dict
(``os.environ._data``) that every write through ``os.environ`` (and pytest's ``monkeypatch.setenv``) updates, so
:func:`get` reads the raw value there with one lookup and parses it again only when it changed. A change is seen by
the next call, exactly as before; an invalid value raises on every call. Elsewhere it reads ``os.environ``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from kda_core.errors import KDAError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(text)


@dataclass(frozen=True)
class Knob:
    name: str
    type: type
    default: object
    allowed: tuple
    doc: str
    invariant: str = ""

    def parse(self, text: str):
        """Parse one environment value; raise :class:`KDAError` naming the knob if it is not allowed."""
        parser: Callable[[str], object] = _parse_bool if self.type is bool else self.type
        try:
            value = parser(text.strip())
        except ValueError:
            value = None
        if value is None or (self.allowed and value not in self.allowed):
            raise KDAError(f"{self.name}: expected one of {self.allowed_text()}, got {text!r}")
        return value

    def allowed_text(self) -> str:
        if self.type is bool:
            return "0/1 (also true/false, yes/no, on/off)"
        return ", ".join(str(a) for a in self.allowed)


KNOBS: dict[str, Knob] = {
    k.name: k
    for k in (
        Knob(
            "KDA_T1_FAST_PATH",
            bool,
            True,
            (True, False),
            "route eligible T=1 calls of recurrent_kda to the T=1 decode kernel (0 sends them to the generic kernel)",
        ),
        Knob(
            "KDA_DECODE_TILE_V",
            int,
            0,
            (0, 8, 16, 32, 64, 128),
            "force the T=1 kernel's state rows per CTA (0 = the schedule policy's choice); for sweeps",
            "must divide V=128; a tile the chosen variant cannot run raises when the call is configured",
        ),
        Knob(
            "KDA_UCACHE_WRING",
            int,
            16,
            (16, 32),
            "replay window of the ucache kernel when the call does not pass w_ring",
            "w_ring 32 needs flush_min > 16; hist_len <= min(w_ring, 32 - T)",
        ),
        Knob(
            "KDA_DEBUG_VALIDATE",
            bool,
            False,
            (True, False),
            "opt-in value checks that synchronise the device: duplicate active slots, ucache cursor ranges",
            "never on inside CUDA-graph capture (the checks are skipped there)",
        ),
        Knob(
            "KDA_ENGINE_PATCH",
            bool,
            False,
            (True, False),
            "vLLM's plugin entry point (kda_recurrent.integrations.vllm:register, loaded in every vLLM process) "
            "replaces vLLM's vendored KDA decode functions with kda's adapters",
            "off: the entry point does nothing, so installing kda-recurrent never changes an engine by itself",
        ),
    )
}


_env = getattr(os.environ, "_data", None)
_ENV_BYTES: dict | None = _env if os.name == "posix" and type(_env) is dict else None
del _env
_PARSED: dict[str, tuple] = {}  # name -> (key bytes, raw value bytes or None, typed value); valid values only


def get(name: str):
    """The typed value of knob ``name`` from the environment, or its default when unset or empty."""
    hit = _PARSED.get(name)
    if hit is not None and _ENV_BYTES.get(hit[0]) == hit[1]:
        return hit[2]
    return _parse_env(name)


def _parse_env(name: str):
    try:
        knob = KNOBS[name]
    except KeyError:
        raise KDAError(f"knob name: expected one of {', '.join(KNOBS)}, got {name!r}") from None
    if _ENV_BYTES is None:
        raw = None
        text = os.environ.get(name, "")
    else:
        key = os.fsencode(name)
        raw = _ENV_BYTES.get(key)
        text = "" if raw is None else os.fsdecode(raw)
    value = knob.default if text.strip() == "" else knob.parse(text)  # raises for an invalid value: not remembered
    if _ENV_BYTES is not None:
        _PARSED[name] = (key, raw, value)
    return value


def table() -> str:
    """The knob table as aligned text: name, type, default, allowed values, doc, invariant."""
    rows = [("knob", "type", "default", "allowed", "current", "what it does")]
    for k in KNOBS.values():
        try:
            current = str(get(k.name))
        except KDAError as err:
            current = f"INVALID ({err})"
        doc = k.doc + (f" [{k.invariant}]" if k.invariant else "")
        rows.append((k.name, k.type.__name__, str(k.default), k.allowed_text(), current, doc))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:5], widths)) + "  " + r[5] for r in rows)


if __name__ == "__main__":
    print(table())
