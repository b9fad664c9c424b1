"""Foreign streams (CuPy, PyTorch, cuda.core, Numba) wrapped without ownership and awaited."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from aiocuda import _driver
from aiocuda.stream import Stream

pytestmark = pytest.mark.anyio


def _cupy() -> tuple[Any, Callable[[Any], None]]:
    cp = pytest.importorskip("cupy")
    stream = cp.cuda.Stream(non_blocking=True)

    def work(s: Any) -> None:
        with s:
            x = cp.arange(1 << 22, dtype=cp.float32)
            (x * 2).sum()

    return stream, work


def _torch() -> tuple[Any, Callable[[Any], None]]:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    stream = torch.cuda.Stream()

    def work(s: Any) -> None:
        with torch.cuda.stream(s):
            x = torch.arange(1 << 22, device="cuda", dtype=torch.float32)
            (x * 2).sum()

    return stream, work


def _cuda_core() -> tuple[Any, Callable[[Any], None]]:
    core = pytest.importorskip("cuda.core")
    dev = core.Device(0)
    dev.set_current()
    return dev.create_stream(), lambda s: None


def _numba() -> tuple[Any, Callable[[Any], None]]:
    nb = pytest.importorskip("numba.cuda")
    try:
        stream = nb.stream()
    except Exception as exc:  # numba-cuda and this cuda-bindings may disagree
        pytest.skip(f"numba-cuda stream unavailable: {exc}")
    return stream, lambda s: None


@pytest.mark.parametrize("make", [_cupy, _torch, _cuda_core, _numba], ids=["cupy", "torch", "cuda.core", "numba"])
async def test_await_foreign_stream(cuda_backend: _driver.Driver, anyio_backend: object, make: Any) -> None:
    foreign, work = make()
    wrapped = Stream.wrap(foreign)
    assert not wrapped.owned
    work(foreign)
    await wrapped
    assert wrapped.query()
    wrapped.close()  # never destroys the foreign stream
    work(foreign)
    await Stream.wrap(foreign)
