"""Shared helpers for the benchmark programs: interleaved timing, three runs, the results file.

Every benchmark writes ``benchmarks/results/<name>.json``::

    {"bench": ..., "device": ..., "devices": ..., "backend": ..., "date": ...,
     "metrics": {...}, "baselines": {...},
     "targets": [{"name", "value", "limit", "op", "met", "runs"}], "runs": {...}}

The rules every benchmark keeps through this module:

* Ours and the baselines are measured in the same run, interleaved in time
  (:func:`wall_medians`), and compared as ratios; absolute times drift between
  machines and are only reported.
* A figure is measured in :data:`RUNS` runs (:func:`repeat`); targets, metrics and
  baselines report the median, and each target keeps its runs' values (``runs``; the
  top-level ``runs`` holds those of the other figures), so the spread is visible.
* ``benchmarks/results/`` holds full runs on a real GPU only: :meth:`Result.write`
  refuses to write there from the simulator or a ``--quick`` run (an explicit ``--out``
  elsewhere is written, for smoke runs).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import functools
import gc
import inspect
import json
import operator
import os
import pathlib
import statistics
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
RUNS = 3
"""Runs of each measurement; a figure is the median of its runs."""

_OPS: dict[str, Callable[[float, float], bool]] = {"<=": operator.le, ">=": operator.ge, "==": operator.eq}
_quick = False  # set by the --quick flag of parser()


async def wall_medians(contenders: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    """Median wall seconds of each contender (a callable; an awaitable it returns is
    awaited), after one warm-up round, over ``rounds`` rounds that run every contender
    once, back to back: the GPU's copy speed drifts over seconds on a shared machine, so
    contenders are interleaved in time, never one after the other's whole series."""
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for round_ in range(rounds + 1):
        for name, fn in contenders.items():
            started = time.perf_counter()
            pending = fn()
            if inspect.isawaitable(pending):
                await pending
            if round_:
                samples[name].append(time.perf_counter() - started)
    return {name: statistics.median(xs) for name, xs in samples.items()}


def _collect(runs: list[dict[str, float]]) -> dict[str, list[float]]:
    names = [name for name in runs[0] if all(name in run for run in runs)]
    return {name: [run[name] for run in runs] for name in names}


def repeat(measure: Callable[[], dict[str, float]], runs: int = RUNS) -> dict[str, list[float]]:
    """Call ``measure`` (one run: a figure per name) ``runs`` times; each figure's values."""
    return _collect([measure() for _ in range(runs)])


async def repeat_async(measure: Callable[[], Awaitable[dict[str, float]]], runs: int = RUNS) -> dict[str, list[float]]:
    """:func:`repeat` for a coroutine function."""
    return _collect([await measure() for _ in range(runs)])


def ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    """Run-by-run ratios: each run's figure over the same run's baseline."""
    if len(numerators) != len(denominators):
        raise ValueError("ratios of runs need as many runs on both sides")
    return [a / b for a, b in zip(numerators, denominators, strict=True)]


class _QuickFlag(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, *_: Any) -> None:
        global _quick
        _quick = True
        setattr(namespace, self.dest, True)


def parser(description: str) -> argparse.ArgumentParser:
    """A parser with the flags every benchmark takes."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--quick", nargs=0, action=_QuickFlag, default=False, help="few repetitions (a smoke run; nothing is written)"
    )
    p.add_argument("--out", type=pathlib.Path, default=None, help="results file (default benchmarks/results/NAME.json)")
    return p


def _median(values: float | Sequence[float]) -> tuple[float, list[float]]:
    runs = [float(values)] if isinstance(values, int | float) else [float(v) for v in values]
    if not runs:
        raise ValueError("a figure needs at least one run")
    return statistics.median(runs), runs


@dataclass
class Result:
    """Collects one benchmark's figures and writes them in the shared format."""

    bench: str
    metrics: dict[str, float] = field(default_factory=dict)
    baselines: dict[str, float] = field(default_factory=dict)
    targets: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    runs: dict[str, list[float]] = field(default_factory=dict)

    def target(self, name: str, values: float | Sequence[float], limit: float, op: str) -> None:
        """Record ``metrics[name]``, the median of ``values`` (one per run; :data:`RUNS`
        of them for a measurement), and whether it meets ``op limit``."""
        median, runs = _median(values)
        value = round(median, 4)
        self.metrics[name] = value
        self.targets.append(
            {
                "name": name,
                "value": value,
                "limit": limit,
                "op": op,
                "met": _OPS[op](value, limit),
                "runs": [round(v, 4) for v in runs],
            }
        )

    def metric(self, name: str, values: float | Sequence[float], digits: int = 4) -> None:
        """Record ``metrics[name]``: the median of ``values``, one per run."""
        self.metrics[name] = self._figure(name, values, digits)

    def baseline(self, name: str, values: float | Sequence[float], digits: int = 4) -> None:
        """Record ``baselines[name]``: the median of ``values``, one per run."""
        self.baselines[name] = self._figure(name, values, digits)

    def _figure(self, name: str, values: float | Sequence[float], digits: int) -> float:
        median, runs = _median(values)
        if len(runs) > 1:
            self.runs[name] = [round(v, digits) for v in runs]
        return round(median, digits)

    def write(self, out: pathlib.Path | None = None, *, merge: bool = False) -> pathlib.Path | None:
        """Print the summary and write the results file; into ``benchmarks/results/``
        only from a full run on a real GPU (returns None where it wrote nothing).

        With ``merge``, the file's figures of an earlier run on the same device are kept
        where this run has none of the same name (a benchmark run in parts, one call
        each: the serve benchmark's loops), and ``parts`` lists each part's date and
        settings."""
        from aiocuda import _driver
        from aiocuda.device import Device

        backend = _driver.driver()
        path = out or RESULTS / f"{self.bench}.json"
        self.print_summary(sys.stdout)
        refused = "a --quick run" if _quick else "the simulator" if backend.name != "cuda" else None
        if refused and path.resolve().is_relative_to(RESULTS):
            print(f"not written: benchmarks/results/ holds full runs on a real GPU, and this was {refused}")
            return None
        doc = {
            "bench": self.bench,
            "device": Device(0).name,
            "devices": backend.device_count(),
            "backend": backend.name,
            "date": datetime.date.today().isoformat(),
            "metrics": self.metrics,
            "baselines": self.baselines,
            "targets": self.targets,
            "runs": self.runs,
            **self.extra,
        }
        if merge:
            doc = _merged(json.loads(path.read_text()), doc) if path.exists() else {**doc, "parts": [_part(doc)]}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
        print(f"wrote {path}")
        return path

    def print_summary(self, stream: Any) -> None:
        print(f"== {self.bench}", file=stream)
        for t in self.targets:
            mark = "ok " if t["met"] else "MISS"
            runs = t.get("runs", [])
            spread = f", runs {min(runs)}-{max(runs)}" if len(runs) > 1 else ", 1 run"
            print(f"  [{mark}] {t['name']} = {t['value']} ({t['op']} {t['limit']}{spread})", file=stream)
        for k, v in self.metrics.items():
            if not any(t["name"] == k for t in self.targets):
                print(f"        {k} = {v}", file=stream)
        for k, v in self.baselines.items():
            print(f"  base  {k} = {v}", file=stream)


def _part(doc: dict[str, Any]) -> dict[str, Any]:
    """What tells one part of a merged results file from another: its date and setup."""
    return {"date": doc["date"], "setup": doc.get("setup")}


def _merged(earlier: dict[str, Any], doc: dict[str, Any]) -> dict[str, Any]:
    """``doc``'s figures over ``earlier``'s (:meth:`Result.write` with ``merge``)."""
    if (earlier.get("bench"), earlier.get("device")) != (doc["bench"], doc["device"]):
        raise ValueError(
            f"cannot merge a {doc['bench']} run on {doc['device']} into the "
            f"{earlier.get('bench')} results of {earlier.get('device')}: run every part on the same device"
        )
    named = {t["name"] for t in doc["targets"]}
    parts = earlier.get("parts") or [_part(earlier)]
    return {
        **doc,
        "metrics": earlier["metrics"] | doc["metrics"],
        "baselines": earlier["baselines"] | doc["baselines"],
        "targets": [t for t in earlier["targets"] if t["name"] not in named] + doc["targets"],
        "runs": earlier.get("runs", {}) | doc["runs"],
        "parts": [*parts, _part(doc)],
    }


_HEARTBEAT = 0.0005


@contextlib.asynccontextmanager
async def stalls_reported(threshold: float = 0.004) -> AsyncIterator[None]:
    """Where ``$AIOCUDA_BENCH_STALLS`` names a file: while the block runs, whenever the
    event loop's thread has not come back to the loop for ``threshold`` seconds, append
    its stack (sampled mid-stall) to that file -- what blocked the loop, found without a
    profiler. Otherwise nothing. Any loop anyio runs."""
    path = os.environ.get("AIOCUDA_BENCH_STALLS")
    if not path:
        yield
        return
    loop_thread = threading.get_ident()
    beat = [time.perf_counter()]
    stop = threading.Event()
    gc_passes: list[tuple[float, float, int]] = []  # the collector's passes: (start, end, generation)
    collecting: list[float] = []

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collecting[:] = [time.perf_counter()]
        elif collecting:
            gc_passes.append((collecting[0], time.perf_counter(), info["generation"]))
            del gc_passes[:-256]

    def collected(since: float, until: float) -> str:
        passes = [(end - start, gen) for start, end, gen in list(gc_passes) if start < until and end > since]
        if not passes:
            return ""
        took, generation = 1e3 * sum(p[0] for p in passes), max(p[1] for p in passes)
        return f" (of which the garbage collector {took:.1f} ms, generation {generation})"

    async def heartbeat() -> None:
        while True:
            beat[0] = time.perf_counter()
            await anyio.sleep(_HEARTBEAT)

    def watch() -> None:
        pending: tuple[float, str] | None = None  # (the beat a stall began after, its stack)
        with open(path, "a") as out:
            while not stop.wait(0.001):
                last = beat[0]
                if pending is not None and last != pending[0]:  # the stall is over: how long it was
                    gc_note = collected(pending[0], last)
                    out.write(f"--- stalled {1e3 * (last - pending[0] - _HEARTBEAT):.1f} ms{gc_note}\n{pending[1]}")
                    out.flush()
                    pending = None
                if pending is None and time.perf_counter() - last > threshold:
                    frame = sys._current_frames().get(loop_thread)
                    pending = (last, "".join(traceback.format_stack(frame)[-14:]) if frame else "?\n")

    watcher = threading.Thread(target=watch, name="stall-watch", daemon=True)
    watcher.start()
    gc.callbacks.append(on_gc)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(heartbeat)
            try:
                yield
            finally:
                tg.cancel_scope.cancel()
    finally:
        gc.callbacks.remove(on_gc)
        stop.set()
        watcher.join()


class SeamMeter:
    """Counts and times the backend's calls, by wrapping its public methods on the
    instance (installed before anything caches a bound method of the backend)."""

    def __init__(self, backend: Any) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        self.seconds = 0.0
        self._depth = 0
        names = [n for n in dir(type(backend)) if not n.startswith("_") and callable(getattr(backend, n))]
        for name in names:
            setattr(backend, name, self._wrap(name, getattr(backend, name)))
        if backend.name == "sim":  # the sim's prepared launches call this, not launch_kernel
            backend._launch_result = self._wrap("launch_kernel", backend._launch_result)

    def _wrap(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        clock = time.perf_counter

        @functools.wraps(method)
        def metered(*args: Any, **kwargs: Any) -> Any:
            if self._depth:  # a call made by another call (none expected): count once
                return method(*args, **kwargs)
            self._depth += 1
            start = clock()
            try:
                result = method(*args, **kwargs)
            finally:
                self.seconds += clock() - start
                self._depth -= 1
                self.calls[name] += 1
            if name == "graph_exec_copy_setter":  # the setter it returns is a driver call too
                return self._wrap("graph_exec_memcpy_node_set_params", result)
            return result

        return metered

    def reset(self) -> None:
        self.calls.clear()
        self.seconds = 0.0
