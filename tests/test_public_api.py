"""The public surface: what each public module exports, what users may construct.

In the manner of anyio's ``tests/test_all_attributes.py``: a public module (no
underscore in its dotted name) lists in ``__all__`` exactly the public names it defines;
internals carry an underscore or live in a private module; public signatures name only
public types.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import importlib.util
import inspect
import pathlib
import pkgutil
import typing
from types import ModuleType
from typing import Any

import pytest

import aiocuda
import aiocuda.testing
from aiocuda import _driver
from aiocuda._util import NoPublicConstructor

PUBLIC_MODULES = [
    "aiocuda",
    *sorted(
        name
        for _, name, _ in pkgutil.walk_packages(aiocuda.__path__, "aiocuda.")
        if "._" not in name
        and name != "aiocuda.__main__"
        # aiocuda.ray needs the optional Ray (tests/ray requires it where CI installs it)
        and not (name.startswith("aiocuda.ray") and importlib.util.find_spec("ray") is None)
    ),
]

# Private types that a public signature may still name, each with the reason.
KNOWN_PRIVATE_IN_SIGNATURES = {
    # A protocol standing for Stream (event.py cannot import stream.py, which imports it).
    ("aiocuda.Event.record", "_OnStream"),
    ("aiocuda.event.Event.record", "_OnStream"),
    # The executor's per-device streams: their public name is the executor's to choose.
    ("aiocuda.Executor.device_streams", "DeviceStreams"),
    ("aiocuda.executor.Executor.device_streams", "DeviceStreams"),
}


def _ruff_order(name: str) -> tuple[int, str]:
    """The order ruff's RUF022 keeps ``__all__`` in: CONSTANTS, Classes, then functions."""
    return (0 if name.isupper() else 1 if name[:1].isupper() else 2, name)


def _defined_names(module: ModuleType) -> set[str]:
    """Public names a module's own source defines at top level (not the ones it imports)."""
    assert module.__file__ is not None
    tree = ast.parse(pathlib.Path(module.__file__).read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if not n.startswith("_")}


def test_there_are_public_modules() -> None:
    assert {"aiocuda", "aiocuda.errors", "aiocuda.kernel", "aiocuda.trace"} <= set(PUBLIC_MODULES)
    assert not any("._" in name for name in PUBLIC_MODULES)


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_all_lists_exactly_the_public_names(name: str) -> None:
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    assert exported is not None, f"{name} has no __all__"
    assert list(exported) == sorted(exported, key=_ruff_order), f"{name}.__all__ is not sorted"
    assert len(set(exported)) == len(exported), f"{name}.__all__ lists a name twice"
    for attr in exported:
        assert not attr.startswith("_"), f"{name}.__all__ exports the internal {attr}"
        assert hasattr(module, attr), f"{name}.__all__ names {attr}, which does not exist"
    missing = _defined_names(module) - set(exported)
    assert not missing, f"{name} defines public names missing from __all__: {sorted(missing)}"


def test_the_package_exports_every_public_attribute() -> None:
    imported_for_itself = {"annotations"}  # from __future__ import annotations
    public = {
        attr
        for attr, value in vars(aiocuda).items()
        if not attr.startswith("_")
        and not (isinstance(value, ModuleType) and attr not in ("errors", "interop", "ipc", "managed", "profiler"))
    }
    assert public - imported_for_itself == set(aiocuda.__all__)


def _public_objects() -> dict[str, Any]:
    found: dict[str, Any] = {}
    for name in PUBLIC_MODULES:
        module = importlib.import_module(name)
        for attr in module.__all__:
            found[f"{name}.{attr}"] = getattr(module, attr)
    return found


def _callables(qualname: str, obj: Any) -> list[tuple[str, Any]]:
    if inspect.isfunction(obj):
        return [(qualname, obj)]
    if inspect.isclass(obj):
        factory_only = isinstance(obj, NoPublicConstructor)  # its __init__ is not public
        members = [] if factory_only else [("__init__", vars(obj).get("__init__"))]
        members += [(m, v) for m, v in vars(obj).items() if not m.startswith("_")]
        out = []
        for member, value in members:
            target = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
            if inspect.isfunction(target):
                out.append((f"{qualname}.{member}", target))
        return out
    return []


def _named_classes(hint: Any) -> list[type]:
    if inspect.isclass(hint):
        return [hint]
    return [cls for arg in typing.get_args(hint) for cls in _named_classes(arg)]


def test_public_signatures_name_only_public_types(sim_backend: _driver.Driver) -> None:
    public = _public_objects()
    public_types = {id(obj) for obj in public.values() if inspect.isclass(obj)}
    offenders = set()
    for qualname, obj in public.items():
        for where, function in _callables(qualname, obj):
            try:
                hints = typing.get_type_hints(function)
            except NameError:  # a name imported only for type checkers: not checkable here
                continue
            for hint in hints.values():
                for cls in _named_classes(hint):
                    if cls.__module__.startswith("aiocuda") and id(cls) not in public_types:
                        offenders.add((where, cls.__name__))
    assert offenders <= KNOWN_PRIVATE_IN_SIGNATURES, sorted(offenders - KNOWN_PRIVATE_IN_SIGNATURES)


def test_internals_are_not_exported() -> None:
    internals = {"EventPool", "PendingSpan", "DeviceLanes", "as_device", "last_finaliser_error", "CompileCache"}
    for name in PUBLIC_MODULES:
        module = importlib.import_module(name)
        assert not internals & set(module.__all__), name


def test_the_version_is_written_once() -> None:
    """``aiocuda.__version__`` is the one place; the package metadata is read from it."""
    root = pathlib.Path(__file__).resolve().parent.parent
    pyproject = (root / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and 'version = { attr = "aiocuda.__version__" }' in pyproject
    assert isinstance(aiocuda.__version__, str) and aiocuda.__version__.count(".") >= 2
    try:
        installed = importlib.metadata.version("aiocuda")
    except importlib.metadata.PackageNotFoundError:  # the source tree alone (PYTHONPATH=src)
        return
    assert installed == aiocuda.__version__


def test_factory_only_classes_refuse_direct_construction(sim_backend: _driver.Driver) -> None:
    for cls, factory in [
        (aiocuda.DeviceBuffer, "MemoryPool.allocate"),
        (aiocuda.MemoryPool, "MemoryPool.for_device"),
        (aiocuda.Kernel, "Module.kernel"),
        (aiocuda.testing.Simulator, r"aiocuda.testing.use_simulator\(\) or current_simulator\(\)"),
    ]:
        with pytest.raises(TypeError, match=f"cannot be constructed directly: use {factory}"):
            cls()
    with aiocuda.MemoryPool.for_device(0).allocate(16) as buffer:  # the factories still work
        assert buffer.size == 16 and type(buffer) is aiocuda.DeviceBuffer
