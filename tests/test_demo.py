"""``python -m aiocuda demo`` and the examples on the simulated backend: they run, say so, check, trace."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest

from aiocuda._cli import demo
from aiocuda._cli.common import UsageError

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"


def test_demo_runs_from_the_command_line(tmp_path: pathlib.Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "AIOCUDA_SIM_DEVICES"}
    env.update(AIOCUDA_BACKEND="sim", PYTHONPATH=f"{SRC}{os.pathsep}{env.get('PYTHONPATH', '')}")
    trace = tmp_path / "demo-trace.json"
    done = subprocess.run(
        [sys.executable, "-m", "aiocuda", "demo", "--chunks", "8", "--chunk-mib", "0.0625", "--trace", str(trace)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr + done.stdout
    assert "SIMULATED backend" in done.stdout
    assert "2 simulated devices" in done.stdout
    assert "results match numpy" in done.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {1, 2}  # GPUs 0 and 1 (Perfetto treats pid 0 as the idle process)
    assert {e["cat"] for e in spans} == {"h2d", "compute", "d2h"}
    assert len(spans) == 3 * 8


def _args(tmp_path: pathlib.Path, **overrides: Any) -> argparse.Namespace:
    values: dict[str, Any] = {
        "chunks": 6,
        "chunk_mib": 0.03125,
        "trace": tmp_path / "t.json",
        "devices": None,
        **overrides,
    }
    return argparse.Namespace(**values)


def test_demo_in_plain_text_on_one_device(
    sim_backend: Any, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(demo, "_ui", demo._Plain)  # as without rich
    assert demo.run_demo(_args(tmp_path, devices=1)) == 0
    out = capsys.readouterr().out
    assert "6/6 chunks" in out and "busy time per unit" in out and "results match numpy" in out
    assert "chunks per device: {0: 6}" in out
    assert (tmp_path / "t.json").is_file()


def test_demo_refuses_more_devices_than_there_are(
    sim_backend: Any, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(UsageError, match="--devices 3: the simulated backend has 2 device"):
        demo.run_demo(_args(tmp_path, devices=3))
    assert capsys.readouterr().out == ""  # refused before the banner


def _run_example(tmp_path: pathlib.Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "AIOCUDA_BACKEND": "sim", "AIOCUDA_SIM_DEVICES": "2"}
    env["PYTHONPATH"] = f"{SRC}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return subprocess.run([sys.executable, *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)


def test_example_pipeline_runs_and_leaves_nothing_in_the_working_folder(tmp_path: pathlib.Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    trace = tmp_path / "trace.json"
    done = _run_example(work, str(SRC.parent / "examples" / "pipeline.py"), str(trace))
    assert done.returncode == 0, done.stderr + done.stdout
    assert "results match numpy" in done.stdout
    assert json.loads(trace.read_text())["traceEvents"]
    assert list(work.iterdir()) == []


def test_example_saxpy_runs(tmp_path: pathlib.Path) -> None:
    done = _run_example(tmp_path, str(SRC.parent / "examples" / "saxpy.py"))
    assert done.returncode == 0, done.stderr + done.stdout
    assert "correct" in done.stdout


def test_example_tests_with_the_simulator_pass(tmp_path: pathlib.Path) -> None:
    example = SRC.parent / "examples" / "test_with_the_simulator.py"
    done = _run_example(tmp_path, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(example))
    assert done.returncode == 0, done.stderr + done.stdout
    assert "3 passed" in done.stdout


def test_example_graphs_runs(tmp_path: pathlib.Path) -> None:
    done = _run_example(tmp_path, str(SRC.parent / "examples" / "graphs.py"))
    assert done.returncode == 0, done.stderr + done.stdout
    assert "three replays and a rebind correct" in done.stdout
