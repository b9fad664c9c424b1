"""Pipelines through Ray GPU actors against the local Executor, and scaling over actors.

Two phases, each with its own local Ray cluster:

1. **GPU** (device 0): the pipeline benchmark's balanced case (``benchmarks/pipeline.py``:
   16 chunks of 32 MiB float32, the ``scale`` kernel at reps 800, whose length is close
   to a chunk's copy) with the inputs starting in the driver process (pinned numpy
   arrays), through

   * ``local``    -- ``Executor.map`` in the driver, results into pinned memory;
   * ``staging``  -- ``aiocuda.ray.map`` over one GPU actor that uploads each chunk from
                     the object store through aiocuda's pinned staging;
   * ``register`` -- the same over an actor that pins the store's pages in place.

   * ``echo``     -- Ray alone: a plain actor (no GPU) given each chunk that returns a
                     new array of its size. What Ray's own moves of the data cost.

   The Ray runs include the driver's put of every input into the object store and the
   actor's return of every result into it (read back zero-copy). Then the same three
   with 512 chunks of 64 KiB and a one-step kernel, where the host's work per chunk is
   what limits: ``(ray - local) / chunks`` is the host time per chunk that Ray adds.
2. **Scaling** (simulated backend in the actors, on the machine's CPUs): chunks of
   64 KiB whose kernel takes a fixed 20 ms of simulated GPU time, 32 per actor, through
   one actor and through four: how the design scales when the GPU is not the limit.
   Each simulated GPU runs one chunk at a time for the target (``chunks_per_device=1``;
   the ideal is 32 x 20 ms per actor); ``ray_scaling_sim_4_concurrent`` repeats it with
   the executor's default 8 chunks at once, where the driver feeding the actors limits.

Wall times are host ``perf_counter`` from the first input to the last result; each
figure is the median over rounds that run every contender of the phase once, back to
back (interleaved: the GPU's copy speed drifts over seconds), with the spread
``(max - min) / median``. Targets: ``ray_vs_local_executor`` = local / Ray (the default
upload) >= 0.9; ``ray_scaling_sim_4`` >= 3.5; ``ray_actor_overhead_us_per_chunk`` and
``upload_register_vs_staging`` reported, and ``ray_put_bound_vs_local`` = local / (chunks x
the median time of one ``ray.put`` of a chunk in the driver): the most
``ray_vs_local_executor`` can be while the driver's puts run one after the other; and
``ray_transfer_bound_vs_local`` = local / ``echo``: the most it can be while Ray moves
each chunk in and a result out at the speed it does with no GPU work at all.

    python benchmarks/ray.py [--rounds N]      (from the repository root; needs Ray)

On the simulated backend (no GPU) it runs small as a smoke test and writes nothing.
"""

from __future__ import annotations

import gc
import os
import pathlib
import shutil
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

# This file is named like the package it measures: keep its folder off the import path
# (the driver's, and through it Ray's workers'), or ``import ray`` would find this file.
HERE = pathlib.Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))
if pathlib.Path.cwd().resolve() == HERE:
    os.chdir(HERE.parent)

import anyio  # noqa: E402
import numpy as np  # noqa: E402
import numpy.typing as npt  # noqa: E402
import ray  # noqa: E402

import aiocuda.ray as aray  # noqa: E402
from aiocuda import _driver  # noqa: E402
from aiocuda._cli.demo import ScaleStage, scale_reference  # noqa: E402
from aiocuda.device import Device  # noqa: E402
from aiocuda.executor import Executor  # noqa: E402
from aiocuda.host import pinned_empty  # noqa: E402
from aiocuda.ray import _transfer  # noqa: E402
from benchmarks._common import RESULTS, Result, parser  # noqa: E402

CHUNKS = 16
BALANCED = 800
SMALL_CHUNKS = 512
SMALL_BYTES = 64 << 10
SIM_KERNEL_S = 0.020
SIM_CHUNKS_PER_ACTOR = 32
SIM_ACTORS = 4


def simulated_gpu_time() -> None:
    """Actor setup for the scaling phase: each kernel takes SIM_KERNEL_S on its stream."""
    _driver.driver().set_latency("launch_kernel", SIM_KERNEL_S)  # type: ignore[attr-defined]


async def interleaved(contenders: dict[str, Callable[[], Awaitable[Any]]], rounds: int) -> dict[str, list[float]]:
    """Wall seconds of each contender in each of ``rounds`` rounds (after a warm-up
    round), every round running each contender once, back to back."""
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for round_ in range(rounds + 1):
        for name, fn in contenders.items():
            gc.collect()
            started = time.perf_counter()
            await fn()
            if round_:
                samples[name].append(time.perf_counter() - started)
    return samples


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def spread(xs: list[float]) -> float:
    return (max(xs) - min(xs)) / statistics.median(xs)


async def local_run(ex: Executor, stage: ScaleStage, data: npt.NDArray[Any], out: npt.NDArray[Any]) -> None:
    async with ex.map(stage, data, output=lambda i, _: out[i]) as results:
        async for _ in results:
            pass


@ray.remote(num_cpus=0)
class Echo:
    """Ray's part of a chunk alone: the input arrives, a result of its size goes back."""

    async def run(self, host: npt.NDArray[Any]) -> npt.NDArray[Any]:
        return np.empty_like(host)


async def echo_run(echo: Any, data: npt.NDArray[Any]) -> None:
    for ref in [echo.run.remote(row) for row in data]:
        await ref


async def ray_run(pool: aray.ActorPool, reps: int, data: npt.NDArray[Any], check: bool = False) -> None:
    async with aray.map(ScaleStage, data, actors=pool, stage_args=(reps,)) as results:
        async for r in results:
            if check and not np.allclose(r.value, scale_reference(data[r.index], reps), rtol=1e-3):
                raise SystemExit(f"Ray results differ from numpy (chunk {r.index}, reps {reps})")


def pinned_random(rows: int, nbytes: int) -> npt.NDArray[np.float32]:
    data = pinned_empty((rows, nbytes // 4), np.float32)
    data[:] = np.random.default_rng(0).random(data.shape, dtype=np.float32)
    return data


async def gpu_phase(result: Result, rounds: int, on_sim: bool) -> None:
    chunk_bytes = (1 << 20) if on_sim else (32 << 20)
    small_chunks = 32 if on_sim else SMALL_CHUNKS
    data, out = pinned_random(CHUNKS, chunk_bytes), pinned_random(CHUNKS, chunk_bytes)
    small, small_out = pinned_random(small_chunks, SMALL_BYTES), pinned_random(small_chunks, SMALL_BYTES)
    balanced, tiny = ScaleStage(BALANCED), ScaleStage(1)
    # Two actors share device 0 (half a GPU each), one per way to upload.
    pools = {way: aray.ActorPool(1, num_gpus=0.5, num_cpus=0, upload=way) for way in ("staging", "register")}
    echo = Echo.remote()
    async with Executor([Device(0)]) as ex, pools["staging"], pools["register"]:
        for pool in pools.values():  # correctness, and each actor's kernels compiled
            await ray_run(pool, BALANCED, data, check=True)
            await ray_run(pool, 1, small, check=True)
        puts = []
        for row in data:
            started = time.perf_counter()
            ray.put(row)
            puts.append(time.perf_counter() - started)
        samples = await interleaved(
            {
                "local": lambda: local_run(ex, balanced, data, out),
                "staging": lambda: ray_run(pools["staging"], BALANCED, data),
                "register": lambda: ray_run(pools["register"], BALANCED, data),
                "echo": lambda: echo_run(echo, data),
                "local_small": lambda: local_run(ex, tiny, small, small_out),
                "staging_small": lambda: ray_run(pools["staging"], 1, small),
                "register_small": lambda: ray_run(pools["register"], 1, small),
            },
            rounds,
        )
        stats = await pools["register"].statistics()
    med = {name: median(xs) for name, xs in samples.items()}
    default = _transfer.UPLOAD
    for name, xs in samples.items():
        result.baselines[f"{name}_ms"] = round(med[name] * 1e3, 3)
        result.baselines[f"{name}_spread"] = round(spread(xs), 4)
    result.baselines["put_32mib_ms"] = round(median(puts) * 1e3, 3) if not on_sim else 0.0
    result.target("ray_vs_local_executor", med["local"] / med[default], 0.9, ">=")
    result.metrics["ray_put_bound_vs_local"] = round(med["local"] / (CHUNKS * median(puts)), 4)
    result.metrics["ray_transfer_bound_vs_local"] = round(med["local"] / med["echo"], 4)
    other = "register" if default == "staging" else "staging"
    result.metrics[f"ray_vs_local_executor_{other}"] = round(med["local"] / med[other], 4)
    result.metrics["upload_register_vs_staging"] = round(med["register"] / med["staging"], 4)
    overhead = (med[f"{default}_small"] - med["local_small"]) / small_chunks
    result.metrics["ray_actor_overhead_us_per_chunk"] = round(overhead * 1e6, 2)
    result.metrics[f"ray_actor_overhead_us_per_chunk_{other}"] = round(
        (med[f"{other}_small"] - med["local_small"]) / small_chunks * 1e6, 2
    )
    assert stats[0] is not None
    result.extra["register_actor"] = {
        "uploads_direct": stats[0].uploads_direct,
        "uploads_staged": stats[0].uploads_staged,
    }
    result.extra["default_upload"] = default


async def scaling_phase(result: Result, rounds: int) -> None:
    per_actor = SIM_CHUNKS_PER_ACTOR
    data = np.random.default_rng(0).random((per_actor * SIM_ACTORS, SMALL_BYTES // 4), dtype=np.float32)
    options: dict[str, Any] = {
        "backend": "sim",
        "num_cpus": 0,  # a smoke run on a 2-CPU machine still places all ten
        "setup": simulated_gpu_time,
    }
    # The target's simulated GPU runs one chunk at a time (20 ms each: the ideal is
    # per_actor x 20 ms); beside it, each actor's executor runs its default 8 chunks at
    # once, so that an actor finishes a chunk every 2.5 ms and the driver feeding it is
    # what limits (reported).
    serial = {**options, "executor": {"compute_streams": 1, "chunks_per_device": 1}}
    async with (
        aray.ActorPool(1, **serial) as one,
        aray.ActorPool(SIM_ACTORS, **serial) as four,
        aray.ActorPool(1, **options) as one_concurrent,
        aray.ActorPool(SIM_ACTORS, **options) as four_concurrent,
    ):
        samples = await interleaved(
            {
                "sim_1": lambda: ray_run(one, 1, data[:per_actor]),
                f"sim_{SIM_ACTORS}": lambda: ray_run(four, 1, data),
                "sim_1_concurrent": lambda: ray_run(one_concurrent, 1, data[:per_actor]),
                f"sim_{SIM_ACTORS}_concurrent": lambda: ray_run(four_concurrent, 1, data),
            },
            rounds,
        )
    med = {name: median(xs) for name, xs in samples.items()}
    for name, xs in samples.items():
        result.baselines[f"{name}_ms"] = round(med[name] * 1e3, 3)
        result.baselines[f"{name}_spread"] = round(spread(xs), 4)
    result.baselines["sim_ideal_ms"] = round(per_actor * SIM_KERNEL_S * 1e3, 3)
    result.target(f"ray_scaling_sim_{SIM_ACTORS}", SIM_ACTORS * med["sim_1"] / med[f"sim_{SIM_ACTORS}"], 3.5, ">=")
    concurrent = SIM_ACTORS * med["sim_1_concurrent"] / med[f"sim_{SIM_ACTORS}_concurrent"]
    result.metrics[f"ray_scaling_sim_{SIM_ACTORS}_concurrent"] = round(concurrent, 4)


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per phase (after one warm-up round)")
    args = p.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    on_sim = _driver.driver().name == "sim"
    rounds = 1 if on_sim or args.quick else args.rounds
    cpus = os.cpu_count() or 2
    result = Result("ray")
    result.extra["config"] = {
        "chunks": CHUNKS,
        "chunk_mib": 1 if on_sim else 32,
        "reps": BALANCED,
        "small_chunks": SMALL_CHUNKS,
        "small_kib": SMALL_BYTES >> 10,
        "sim_kernel_ms": SIM_KERNEL_S * 1e3,
        "sim_chunks_per_actor": SIM_CHUNKS_PER_ACTOR,
        "rounds": rounds,
        "cpus": cpus,
        "ray": ray.__version__,
        # Ray's object store lives in /dev/shm when it fits there (else in /tmp, slower).
        "dev_shm_gib": round(shutil.disk_usage("/dev/shm").total / (1 << 30), 1) if os.path.isdir("/dev/shm") else 0,
        "simulated": on_sim,
    }
    init = {"include_dashboard": False, "configure_logging": False, "object_store_memory": 4 << 30}
    ray.init(num_cpus=cpus, num_gpus=1 if on_sim else None, **init)
    try:
        anyio.run(gpu_phase, result, rounds, on_sim)
    finally:
        ray.shutdown()
    # The simulated actors take declared GPUs: a cluster of their own.
    ray.init(num_cpus=cpus, num_gpus=2 * (1 + SIM_ACTORS), **init)
    try:
        anyio.run(scaling_phase, result, rounds)
    finally:
        ray.shutdown()
    if on_sim:
        result.print_summary(sys.stdout)
        print("simulated backend: a smoke run, nothing written")
        return
    out = args.out or (RESULTS / f"{result.bench}.json")
    result.write(out)


if __name__ == "__main__":
    main()
