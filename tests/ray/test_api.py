"""aiocuda.ray's surface without a cluster: the optional import, argument checks, and
which devices an actor takes."""

from __future__ import annotations

import subprocess
import sys

import pytest

import aiocuda.ray as aray
from aiocuda import _driver
from aiocuda._cli.demo import ScaleStage
from aiocuda.errors import ClosedError
from aiocuda.ray._actor import assigned_devices

from . import _stages


def test_importing_aiocuda_does_not_import_ray() -> None:
    code = "import sys, aiocuda, aiocuda.executor; assert 'ray' not in sys.modules, 'ray imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_all_is_sorted_and_complete() -> None:
    assert aray.__all__ == sorted(aray.__all__)
    assert all(hasattr(aray, name) for name in aray.__all__)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"actors": 0}, "actors must be >= 1"),
        ({"num_gpus": 0}, "num_gpus > 0"),
        ({"chunks_per_actor": 0}, "chunks_per_actor must be >= 1"),
        ({"upload": "mmap"}, "upload must be"),
    ],
)
def test_pool_arguments_are_checked(kwargs: dict[str, object], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        aray.ActorPool(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"actors": "2"}, "actors must be an int, not str"),
        ({"actors": 2.5}, "actors must be an int, not float"),
        ({"num_gpus": "1"}, "num_gpus must be a number, not str"),
        ({"num_cpus": None}, "num_cpus must be a number, not NoneType"),
        ({"chunks_per_actor": 2.5}, "chunks_per_actor must be an int, not float"),
    ],
)
def test_pool_argument_types_are_checked(kwargs: dict[str, object], error: str) -> None:
    with pytest.raises(TypeError, match=error):
        aray.ActorPool(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"on_error": "ignore"}, "on_error must be"),
        ({"placement": "random"}, "unknown placement"),
        ({"in_flight": 0}, "in_flight must be >= 1"),
        ({"retries": -1}, "retries must be >= 0"),
    ],
)
def test_map_arguments_are_checked(kwargs: dict[str, object], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        aray.map(_stages.identity, [], **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("stage", "kwargs", "error"),
    [
        (42, {}, "stage must be a function or a class, not int"),
        (_stages.identity, {"ordered": "yes"}, "ordered must be True or False"),
        (_stages.identity, {"retries": 1.5}, "retries must be an int"),
        (_stages.identity, {"in_flight": "4"}, "in_flight must be an int"),
    ],
)
def test_map_argument_types_are_checked(stage: object, kwargs: dict[str, object], error: str) -> None:
    with pytest.raises(TypeError, match=error):
        aray.map(stage, [], **kwargs)  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_a_map_is_read_inside_its_block() -> None:
    results = aray.map(_stages.identity, [])
    with pytest.raises(RuntimeError, match="inside its block: async with"):
        async for _ in results:
            pass


@pytest.mark.anyio
async def test_an_ended_pool_does_not_start_again() -> None:
    pool = aray.ActorPool(1)
    pool.kill()  # as aclose() ends it
    with pytest.raises(ClosedError, match="ActorPool was ended"):
        await pool.wait_ready()
    with pytest.raises(ClosedError, match="ActorPool was ended"):
        async with aray.map(_stages.identity, [], actors=pool):
            pass


def test_stage_args_need_a_class_stage() -> None:
    with pytest.raises(TypeError, match="class stage"):
        aray.map(_stages.identity, [], stage_args=(1,))
    aray.map(ScaleStage, [], stage_args=(1,))  # a class takes them


def test_pool_options_need_a_new_pool() -> None:
    pool = aray.ActorPool(1)
    with pytest.raises(TypeError, match="new pool"):
        aray.map(_stages.identity, [], actors=pool, num_gpus=2)


def test_an_actor_uses_the_devices_ray_made_visible() -> None:
    _driver.use_backend("sim", devices=4)
    assert assigned_devices([3], visible=1) is None  # CUDA_VISIBLE_DEVICES=3: device 0 is it
    assert assigned_devices([0, 2], visible=2) is None
    chosen = assigned_devices([1, 3], visible=4)  # Ray left every device visible
    assert chosen is not None and [d.ordinal for d in chosen] == [1, 3]
    assert assigned_devices(["GPU-1234"], visible=4) is None
