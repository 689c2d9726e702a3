"""Install kda's adapters in a serving engine by replacing the engine's vendored KDA decode functions.

- :mod:`kda_recurrent.integrations.vllm`: ``enable()`` / ``disable()`` for vLLM (Kimi K3, Kimi-Linear).
- :mod:`kda_recurrent.integrations.sglang`: ``enable()`` / ``disable()`` for SGLang.

How a replacement is made (:class:`Patcher`): for each target (the engine module that defines a function, and the
function's name) whose module imports, the function found there is the *original*. Its signature must be one the
kda adapter accepts (every positional parameter in the same place, every keyword present), else the target is
skipped with a warning: an engine whose call changed keeps its own function. Then every loaded module of the
engine's package whose attribute of that name *is* the original gets the adapter instead: the defining module, the
package that re-exports it, and each caller that did ``from ... import name`` (which binds the name in the
caller's module). A module imported later reads the defining module's attribute, so it gets the adapter too.
A dotted name (``"Class.method"``) is a method of a class the module defines: it is replaced in the class itself,
so every instance, and every subclass that does not define its own, calls the adapter (which takes ``self``).

``enable()`` is idempotent (a second call finds the adapters installed and patches nothing new); ``disable()``
puts every original back, also in modules that bound the adapter after ``enable()``. Each replacement and each
restoration is logged (``logging``, one line each, logger ``kda_recurrent.integrations``); both return the dotted
names they changed. Nothing here reads the environment.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import sys
from dataclasses import dataclass
from typing import Callable

__all__ = ["Patcher", "Target", "original"]

logger = logging.getLogger(__name__)

_ORIGINALS: dict[tuple[str, str], Callable] = {}  # (module, name) -> the engine function an adapter replaced


def original(module: str, name: str) -> Callable | None:
    """The engine's own ``module.name`` that a kda adapter replaced and still stands in for, else None: for an adapter
    that hands some calls back to the engine (a device kda's kernels are not tested on, say)."""
    return _ORIGINALS.get((module, name))


@dataclass(frozen=True)
class Target:
    """One engine function to replace: ``module`` defines ``name`` (or ``"Class.method"``, a method of a class it
    defines); ``adapter`` is ``"package.module:function"``."""

    module: str
    name: str
    adapter: str
    via: tuple[str, ...] = ()
    """For a class: the attributes (its constructor and methods the engine calls) whose signatures must match;
    empty for a function, whose own signature is compared."""
    requires: tuple[str, str] | None = None
    """``(module, name)`` of an earlier target: this one is installed only while that one holds kda's adapter (a
    backend test that routes calls to an adapter)."""

    def mismatch(self, original, adapter) -> str | None:
        """Why ``adapter`` cannot stand in for ``original`` (:func:`signature_mismatch`, per ``via`` attribute)."""
        if not self.via:
            return signature_mismatch(original, adapter)
        for attr in self.via:
            if not hasattr(original, attr) or not hasattr(adapter, attr):
                return f"{attr!r} missing"
            why = signature_mismatch(getattr(original, attr), getattr(adapter, attr))
            if why is not None:
                return f"{attr}: {why}"
        return None

    def load_adapter(self) -> Callable:
        module, function = self.adapter.split(":")
        return getattr(importlib.import_module(module), function)


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def signature_mismatch(original: Callable, adapter: Callable) -> str | None:
    """Why ``adapter`` cannot stand in for ``original`` (None when it can): each positional parameter of the
    original must be the adapter's in the same place, each keyword parameter the adapter's too, and an original
    taking ``**kwargs`` needs an adapter taking them."""
    try:
        ours = inspect.signature(adapter).parameters
        theirs = inspect.signature(original).parameters
    except (TypeError, ValueError) as err:
        return f"signature not readable ({err})"
    our_positional = [n for n, p in ours.items() if p.kind in _POSITIONAL]
    their_positional = [n for n, p in theirs.items() if p.kind in _POSITIONAL]
    if our_positional[: len(their_positional)] != their_positional:
        return f"positional parameters {their_positional} are not a prefix of the adapter's {our_positional}"
    our_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in ours.values())
    for name, p in theirs.items():
        if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in ours and not our_var_kw:
            return f"keyword parameter {name!r} is not the adapter's"
        if p.kind is inspect.Parameter.VAR_KEYWORD and not our_var_kw:
            return "the engine's function takes **kwargs, the adapter does not"
    return None


class Patcher:
    """Replaces an engine's functions by kda's adapters and puts them back (see the module docstring).

    ``package``: the engine's top-level package name (``"vllm"``); only its modules are scanned and patched.
    """

    def __init__(self, package: str, targets: tuple[Target, ...], engine: str = ""):
        self.package = package
        self.engine = engine or package  # the engine's name in log lines
        self.targets = targets
        self._originals: dict[Target, Callable] = {}  # target -> the engine's function it replaced
        self._patched: dict[tuple[str, str], Target] = {}  # (module, name) -> target, for every replaced attribute

    def _engine_modules(self):
        """(name, namespace dict) of every loaded module of the engine's package (entries without a plain
        ``__dict__``, e.g. a None placeholder, are skipped)."""
        prefix = self.package + "."
        found = []
        for name, module in list(sys.modules.items()):
            if name == self.package or name.startswith(prefix):
                namespace = getattr(module, "__dict__", None)
                if isinstance(namespace, dict):
                    found.append((name, namespace))
        return found

    def enable(self, require_kernels: bool = True) -> list[str]:
        """Install every adapter whose engine module imports; returns the ``module.name`` attributes replaced now.
        ``require_kernels``: do nothing (with a warning) when kda-cute is not installed, since the adapters would
        run kda-core's oracle."""
        if require_kernels and importlib.util.find_spec("kda_cute") is None:
            logger.warning("kda: kda-cute is not installed; %s keeps its own KDA decode (install kda-recurrent[cute])",
                           self.engine)
            return []
        replaced = []
        modules = None
        for target in self.targets:
            try:
                defining = importlib.import_module(target.module)
            except ImportError as err:
                logger.debug("kda: %s not importable (%s); %s left alone", target.module, err, target.name)
                continue
            except Exception as err:  # an engine module that fails at import is the engine's to report, not ours
                logger.warning("kda: importing %s failed (%s: %s); %s left alone", target.module,
                               type(err).__name__, err, target.name)
                continue
            if target.requires is not None and not self._holds_adapter(*target.requires):
                logger.warning("kda: %s.%s kept: %s.%s is not kda's", target.module, target.name, *target.requires)
                continue
            adapter = target.load_adapter()
            owner, attr = _owner(defining, target.name)
            current = _get(owner, attr)
            original = self._originals.get(target)
            if current is None:
                logger.warning("kda: %s has no %s; nothing replaced", target.module, target.name)
                continue
            if current is not adapter:
                why = target.mismatch(current, adapter)
                if why is not None:
                    logger.warning("kda: %s.%s kept: %s", target.module, target.name, why)
                    continue
                original = current
                self._originals[target] = original
                _ORIGINALS[(target.module, target.name)] = original
            if original is None:  # the adapter was installed by another Patcher, or by hand: not ours to manage
                continue
            if isinstance(owner, type):  # a method: the class is the one place that holds it
                if current is original:
                    setattr(owner, attr, adapter)
                    self._patched[(target.module, target.name)] = target
                    replaced.append(f"{target.module}.{target.name}")
                    logger.info("kda: %s.%s -> %s", target.module, target.name, target.adapter.replace(":", "."))
                continue
            modules = self._engine_modules() if modules is None else modules
            for module_name, namespace in modules:
                if namespace.get(target.name) is original:
                    namespace[target.name] = adapter
                    self._patched[(module_name, target.name)] = target
                    replaced.append(f"{module_name}.{target.name}")
                    logger.info("kda: %s.%s -> %s", module_name, target.name, target.adapter.replace(":", "."))
        return replaced

    def _holds_adapter(self, module: str, name: str) -> bool:
        """Whether ``module.name`` is now the adapter of this patcher's target of that name."""
        for target in self.targets:
            if (target.module, target.name) == (module, name):
                return _holds(module, name, target.load_adapter())
        return False

    def disable(self) -> list[str]:
        """Put every engine function back, in each module holding an adapter; returns the attributes restored."""
        restored = []
        modules = self._engine_modules()
        for target, original in self._originals.items():
            adapter = target.load_adapter()
            owner, attr = _owner(sys.modules.get(target.module), target.name)
            if isinstance(owner, type):
                if _get(owner, attr) is adapter:
                    setattr(owner, attr, original)
                    restored.append(f"{target.module}.{target.name}")
                    logger.info("kda: %s.%s restored", target.module, target.name)
                continue
            for module_name, namespace in modules:
                if namespace.get(target.name) is adapter:
                    namespace[target.name] = original
                    restored.append(f"{module_name}.{target.name}")
                    logger.info("kda: %s.%s restored", module_name, target.name)
        for target in self._originals:
            _ORIGINALS.pop((target.module, target.name), None)
        self._originals.clear()
        self._patched.clear()
        return restored

    def patched(self) -> list[str]:
        """The ``module.name`` attributes that hold an adapter now (installed by this patcher)."""
        return [f"{m}.{n}" for (m, n), target in self._patched.items() if _holds(m, n, target.load_adapter())]


def _owner(module, name: str):
    """Where ``name`` lives in ``module``: (the module's namespace dict, name), or for ``"Class.method"`` (the class,
    method); (None, name) when the module or the class is missing."""
    namespace = getattr(module, "__dict__", None)
    if not isinstance(namespace, dict):
        return None, name
    if "." not in name:
        return namespace, name
    cls_name, attr = name.split(".", 1)
    cls = namespace.get(cls_name)
    return (cls, attr) if isinstance(cls, type) else (None, attr)


def _get(owner, attr: str):
    """``attr`` of an owner :func:`_owner` found (a module's namespace or a class, not its bases), else None."""
    if owner is None:
        return None
    return owner.get(attr) if isinstance(owner, dict) else vars(owner).get(attr)


def _holds(module: str, name: str, adapter) -> bool:
    """Whether ``module``'s ``name`` (a dotted name: a class's method) is ``adapter`` now."""
    return _get(*_owner(sys.modules.get(module), name)) is adapter
