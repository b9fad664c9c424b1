"""Shared helpers for the benchmark programs: timing statistics and the results file.

Every benchmark writes ``benchmarks/results/<name>.json``::

    {"bench": ..., "device": ..., "date": ..., "backend": ...,
     "metrics": {...}, "baselines": {...}, "targets": [{"name", "value", "limit", "op", "met"}]}

Ratios are taken from numbers measured in the same run; absolute times drift between
machines and are only reported as baselines.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import operator
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
_OPS: dict[str, Callable[[float, float], bool]] = {"<=": operator.le, ">=": operator.ge, "==": operator.eq}


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


def parser(description: str) -> argparse.ArgumentParser:
    """A parser with the flags every benchmark takes."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="few repetitions (smoke run, e.g. on the simulator)")
    p.add_argument("--out", type=pathlib.Path, default=None, help="results file (default benchmarks/results/NAME.json)")
    return p


@dataclass
class Result:
    """Collects one benchmark's figures and writes them in the shared format."""

    bench: str
    metrics: dict[str, float] = field(default_factory=dict)
    baselines: dict[str, float] = field(default_factory=dict)
    targets: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def target(self, name: str, value: float, limit: float, op: str) -> None:
        """Record ``metrics[name] = value`` and whether ``value op limit`` holds."""
        value = round(float(value), 4)
        self.metrics[name] = value
        self.targets.append({"name": name, "value": value, "limit": limit, "op": op, "met": _OPS[op](value, limit)})

    def write(self, out: pathlib.Path | None = None) -> pathlib.Path:
        from aiocuda import _driver
        from aiocuda.device import Device

        backend = _driver.driver()
        doc = {
            "bench": self.bench,
            "device": Device(0).name,
            "devices": backend.device_count(),
            "backend": backend.name,
            "date": datetime.date.today().isoformat(),
            "metrics": self.metrics,
            "baselines": self.baselines,
            "targets": self.targets,
            **self.extra,
        }
        path = out or RESULTS / f"{self.bench}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
        self.print_summary(sys.stdout)
        return path

    def print_summary(self, stream: Any) -> None:
        print(f"== {self.bench}", file=stream)
        for t in self.targets:
            mark = "ok " if t["met"] else "MISS"
            print(f"  [{mark}] {t['name']} = {t['value']} ({t['op']} {t['limit']})", file=stream)
        for k, v in self.metrics.items():
            if not any(t["name"] == k for t in self.targets):
                print(f"        {k} = {v}", file=stream)
        for k, v in self.baselines.items():
            print(f"  base  {k} = {v}", file=stream)
