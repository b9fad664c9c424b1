"""The shared helpers of aiocuda._util."""

from __future__ import annotations

import os

import numpy as np
import pytest

import aiocuda
from aiocuda import _driver
from aiocuda._util import PerProcess, byte_span, c_strides, format_bytes, invalid_value, shape_tuple
from aiocuda.errors import ArgumentError, ResultCode


def test_format_bytes() -> None:
    assert [format_bytes(n) for n in (0, 1023, 1024, 1536, 5 << 20, 3 << 30, 1 << 50)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "1.5 KiB",
        "5.0 MiB",
        "3.0 GiB",
        "1024.0 TiB",
    ]


def test_invalid_value_is_coded_as_the_driver_would() -> None:
    error = invalid_value("bad")
    assert isinstance(error, ArgumentError) and isinstance(error, ValueError)
    assert (error.code, error.name, str(error)) == (ResultCode.INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "bad")


def test_shape_tuple_takes_integers_only() -> None:
    assert shape_tuple(3) == (3,) and shape_tuple((2, np.int64(4))) == (2, 4) and shape_tuple(()) == ()
    with pytest.raises(ArgumentError, match="negative dimension"):
        shape_tuple((2, -1))
    for shape in (2.5, [2, 3], (2, 3.0), np.array([2, 3]), True, "3"):
        # (operator.index's "'list' object cannot be interpreted as an integer", and a
        # bool taken as 1)
        with pytest.raises(TypeError, match=r"a shape must be an int or a tuple of ints, not "):
            shape_tuple(shape)  # type: ignore[arg-type]


def test_strides_and_byte_span() -> None:
    assert c_strides((2, 3, 4), 8) == (96, 32, 8) and c_strides((0, 3), 4) == (12, 4)
    assert byte_span((2, 3), (12, 4), 4) == (0, 24)
    assert byte_span((3,), (-4,), 4) == (-8, 4)  # a reversed view reaches back from its first element
    assert byte_span((0, 3), (12, 4), 4) == (0, 0)


def test_host_and_device_shapes_share_the_checks(sim_backend: _driver.Driver) -> None:
    for make in (aiocuda.pinned_empty, aiocuda.empty):
        with pytest.raises(ArgumentError, match="negative dimension"):
            make((2, -3))
        with pytest.raises(TypeError):
            make(2.5)  # type: ignore[arg-type]


def test_per_process_makes_one_object_and_a_new_one_after_fork(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[object] = []
    single = PerProcess(lambda: made.append(object()) or made[-1])
    first = single.get()
    assert single.get() is first and len(made) == 1
    monkeypatch.setattr(os, "getpid", lambda: -1)  # as in a forked child
    child = single.get()
    assert child is not first and single.get() is child and len(made) == 2
