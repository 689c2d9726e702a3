"""The environment knob registry: typed values, defaults, errors that name the knob, and the printed table."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kda_core import knobs
from kda_core.errors import KDAError

NAMES = ("KDA_T1_FAST_PATH", "KDA_DECODE_TILE_V", "KDA_UCACHE_WRING", "KDA_DEBUG_VALIDATE", "KDA_ENGINE_PATCH")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)


def test_every_knob_is_declared_once_with_doc_and_default():
    assert tuple(knobs.KNOBS) == NAMES
    for knob in knobs.KNOBS.values():
        assert knob.doc and knob.default in knob.allowed


@pytest.mark.parametrize("name, default", [("KDA_T1_FAST_PATH", True), ("KDA_DECODE_TILE_V", 0),
                                           ("KDA_UCACHE_WRING", 16), ("KDA_DEBUG_VALIDATE", False)])
def test_defaults_when_unset_or_blank(monkeypatch, name, default):
    assert knobs.get(name) == default
    monkeypatch.setenv(name, "  ")
    assert knobs.get(name) == default


@pytest.mark.parametrize("text, value", [("0", False), ("1", True), ("true", True), ("OFF", False), (" yes ", True)])
def test_bool_knob_spellings(monkeypatch, text, value):
    monkeypatch.setenv("KDA_T1_FAST_PATH", text)
    assert knobs.get("KDA_T1_FAST_PATH") is value


@pytest.mark.parametrize("name, text, value", [("KDA_DECODE_TILE_V", "32", 32), ("KDA_DECODE_TILE_V", "128", 128),
                                               ("KDA_UCACHE_WRING", "32", 32)])
def test_int_knob_values(monkeypatch, name, text, value):
    monkeypatch.setenv(name, text)
    assert knobs.get(name) == value


@pytest.mark.parametrize("name, text, allowed", [
    ("KDA_T1_FAST_PATH", "2", "0/1"),
    ("KDA_DEBUG_VALIDATE", "sometimes", "0/1"),
    ("KDA_DECODE_TILE_V", "48", "0, 8, 16, 32, 64, 128"),
    ("KDA_DECODE_TILE_V", "sixteen", "0, 8, 16, 32, 64, 128"),
    ("KDA_UCACHE_WRING", "24", "16, 32"),
    ("KDA_UCACHE_WRING", "16.0", "16, 32"),
])
def test_invalid_value_names_the_knob_and_the_allowed_values(monkeypatch, name, text, allowed):
    monkeypatch.setenv(name, text)
    with pytest.raises(KDAError) as info:
        knobs.get(name)
    msg = str(info.value)
    assert msg.startswith(f"{name}: expected one of ") and allowed in msg and repr(text) in msg


def test_unknown_knob_name_is_an_error():
    with pytest.raises(KDAError, match=r"^knob name: expected one of KDA_T1_FAST_PATH.*got 'KDA_NOPE'"):
        knobs.get("KDA_NOPE")


def test_values_are_read_at_call_time(monkeypatch):
    monkeypatch.setenv("KDA_UCACHE_WRING", "32")
    assert knobs.get("KDA_UCACHE_WRING") == 32
    monkeypatch.setenv("KDA_UCACHE_WRING", "16")
    assert knobs.get("KDA_UCACHE_WRING") == 16


def test_every_change_is_seen_by_the_next_read_and_an_invalid_value_raises_every_time(monkeypatch):
    # get() re-parses only when the raw environment value changed: set, change, break, fix, unset, set again.
    assert knobs.get("KDA_DECODE_TILE_V") == 0
    for text, value in (("16", 16), ("16", 16), ("64", 64), (" 64", 64), ("", 0), ("8", 8)):
        monkeypatch.setenv("KDA_DECODE_TILE_V", text)
        assert knobs.get("KDA_DECODE_TILE_V") == value
    monkeypatch.setenv("KDA_DECODE_TILE_V", "24")
    for _ in range(2):
        with pytest.raises(KDAError, match="^KDA_DECODE_TILE_V: expected"):
            knobs.get("KDA_DECODE_TILE_V")
    monkeypatch.setenv("KDA_DECODE_TILE_V", "32")
    assert knobs.get("KDA_DECODE_TILE_V") == 32
    monkeypatch.delenv("KDA_DECODE_TILE_V")
    assert knobs.get("KDA_DECODE_TILE_V") == 0
    os.environ["KDA_DECODE_TILE_V"] = "128"  # a plain os.environ write, not only monkeypatch
    try:
        assert knobs.get("KDA_DECODE_TILE_V") == 128
    finally:
        del os.environ["KDA_DECODE_TILE_V"]
    assert knobs.get("KDA_DECODE_TILE_V") == 0


def _run_table(env_extra):
    env = {k: v for k, v in os.environ.items() if k not in NAMES}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-m", "kda_core.knobs"], capture_output=True, text=True, env=env,
                          check=True).stdout


def test_python_m_knobs_prints_the_table_with_current_values():
    lines = _run_table({"KDA_DECODE_TILE_V": "64"}).splitlines()
    assert lines[0].split()[:5] == ["knob", "type", "default", "allowed", "current"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert set(rows) == set(NAMES)
    assert rows["KDA_DECODE_TILE_V"].split()[:3] == ["KDA_DECODE_TILE_V", "int", "0"]
    assert " 64 " in rows["KDA_DECODE_TILE_V"]
    assert "w_ring 32 needs flush_min > 16" in rows["KDA_UCACHE_WRING"]


def test_python_m_knobs_flags_an_invalid_value_instead_of_crashing():
    out = _run_table({"KDA_UCACHE_WRING": "7"})
    row = next(line for line in out.splitlines() if line.startswith("KDA_UCACHE_WRING"))
    assert "INVALID" in row and "'7'" in row
