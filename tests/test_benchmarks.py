"""The benchmarks' shared rules: results from three runs, written only from full GPU runs."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest

import aiocuda.device
from benchmarks import _common

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _result() -> _common.Result:
    result = _common.Result("unit")
    result.target("ratio", [1.2, 0.9, 1.0], 1.1, "<=")
    result.target("verified", 1.0, 1, "==")
    result.metric("speed_us", [3.0, 5.0, 4.0])
    result.baseline("raw_us", [2.0, 2.5, 2.25])
    return result


def test_a_figure_is_the_median_of_its_runs() -> None:
    result = _result()
    ratio, verified = result.targets
    assert ratio == {"name": "ratio", "value": 1.0, "limit": 1.1, "op": "<=", "met": True, "runs": [1.2, 0.9, 1.0]}
    assert verified["runs"] == [1.0] and verified["met"]
    assert (result.metrics["speed_us"], result.baselines["raw_us"]) == (4.0, 2.25)
    assert result.runs == {"speed_us": [3.0, 5.0, 4.0], "raw_us": [2.0, 2.5, 2.25]}
    assert _common.ratios([2.0, 3.0], [1.0, 2.0]) == [2.0, 1.5]
    assert _common.repeat(iter([{"a": 1.0}, {"a": 2.0}, {"a": 3.0}]).__next__) == {"a": [1.0, 2.0, 3.0]}


def test_results_are_written_only_from_full_runs_on_a_gpu(
    sim_backend: Any, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_common, "RESULTS", tmp_path / "results")
    assert _result().write() is None  # the simulator
    monkeypatch.setattr(_common, "_quick", True)
    assert _result().write(tmp_path / "results" / "unit.json") is None  # --quick, pointed at results/ itself
    assert not (tmp_path / "results").exists()
    smoke = _result().write(tmp_path / "smoke.json")  # elsewhere: a smoke run's file
    assert smoke is not None
    doc = json.loads(smoke.read_text())
    assert doc["backend"] == "sim" and doc["targets"][0]["runs"] == [1.2, 0.9, 1.0]


def test_a_run_in_parts_merges_into_one_results_file(
    sim_backend: Any, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A benchmark run in parts (one loop per call): a merging write keeps the earlier
    part's figures that the new part does not measure, replaces those it does, and
    lists the parts; a part from another device is refused, the file untouched."""
    path = tmp_path / "unit.json"
    first = _common.Result("unit")
    first.target("x_asyncio", [1.0, 1.2, 1.1], 1.0, ">=")
    first.target("shared", [0.5], 1.0, ">=")
    first.baseline("asyncio.cpu", [2.0, 3.0, 4.0])
    first.extra["setup"] = {"loops": ["asyncio"]}
    assert first.write(path, merge=True) == path
    second = _common.Result("unit")
    second.target("x_uvloop", [0.8, 0.9, 1.0], 1.0, ">=")
    second.target("shared", [1.5], 1.0, ">=")
    second.extra["setup"] = {"loops": ["uvloop"]}
    second.write(path, merge=True)
    doc = json.loads(path.read_text())
    met = [(t["name"], t["met"]) for t in doc["targets"]]
    assert met == [("x_asyncio", True), ("x_uvloop", False), ("shared", True)]
    assert doc["baselines"] == {"asyncio.cpu": 3.0} and doc["runs"]["asyncio.cpu"] == [2.0, 3.0, 4.0]
    assert [part["setup"]["loops"] for part in doc["parts"]] == [["asyncio"], ["uvloop"]]
    written = path.read_text()
    monkeypatch.setattr(aiocuda.device.Device, "name", property(lambda self: "another GPU"))
    with pytest.raises(ValueError, match="same device"):
        second.write(path, merge=True)
    assert path.read_text() == written


def test_a_benchmark_runs_on_the_simulator(tmp_path: pathlib.Path) -> None:
    """The launch benchmark's simulated path, as a smoke test (the others take longer)."""
    out = tmp_path / "launch.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "launch.py"), "--quick", "--out", str(out)],
        env={**os.environ, "AIOCUDA_BACKEND": "sim"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(json.loads(out.read_text())["runs"]["aiocuda_us"]) == _common.RUNS


def test_the_ab_script_exports_a_revision_and_runs_trees_in_turn(tmp_path: pathlib.Path) -> None:
    """scripts/ab: a revision's package exported from git, then the service load on two
    trees (the simulator: a smoke run), each tree's figures reported."""
    script = [sys.executable, str(ROOT / "scripts" / "ab")]
    exported = subprocess.run(
        [*script, "export", "HEAD", "--into", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert exported.returncode == 0, exported.stderr
    assert (tmp_path / "HEAD" / "aiocuda" / "__init__.py").is_file()
    small = ["--rounds", "1", "--loops", "asyncio", "--ws", "1", "--per-task", "2", "--inner", "1"]
    done = subprocess.run(
        [*script, "service", f"old={tmp_path / 'HEAD'}", "new=src", *small],
        env={**os.environ, "AIOCUDA_BACKEND": "sim"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "asyncio 1ms old cpu_vs_poll" in done.stdout and "asyncio 1ms new throughput_vs_poll" in done.stdout


@pytest.mark.parametrize(("load", "jitter"), [("open", "0"), ("closed", "0"), ("open", "0.3")])
def test_the_ab_scripts_model_runs_without_a_gpu(load: str, jitter: str) -> None:
    """scripts/ab model: the modelled server, polling and the engine's waits in turn on a
    tree, each way's lateness after its kernel's end and CPU per request reported."""
    small = ["--rounds", "1", "--loops", "asyncio", "--ws", "1", "--seconds", "0.1", "--rate", "300"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "ab"), "model", "one=src", "--load", load, "--jitter", jitter, *small],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for way in ("lanes", "poll"):
        assert f"asyncio 1ms one {way} late_p50_ms" in done.stdout, done.stdout
        assert f"asyncio 1ms one {way} cpu_us_per_req" in done.stdout, done.stdout


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        (["--rate", "0"], "must be positive"),
        (["--seconds", "-1"], "must be positive"),
        (["--ws", "0"], "must be positive"),
        (["--jitter", "-0.1"], "--jitter must be"),
        (["--ws", "1", "--jitter", "1"], "--jitter must be"),
        (["--jitter", "5", "--ws", "1", "5"], "--jitter must be"),
        (["--endpoints", "submit"], "--endpoints is an option of the serve mode"),
    ],
)
def test_the_ab_script_refuses_a_load_it_cannot_run(bad: list[str], says: str) -> None:
    """scripts/ab: a rate, window or kernel length of zero or less, or a jitter that would
    leave a kernel no length, is a usage error, not a division by zero in a child."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "ab"), "model", "one=src", *bad],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert says in done.stderr
