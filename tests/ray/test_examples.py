"""The Ray examples run from the source tree as a user would run them (each starts and
ends its own local Ray; the simulated backend without a GPU)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from .conftest import ROOT


def run_example(name: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.timeout(300)
def test_pipeline_example() -> None:
    out = run_example("ray_pipeline.py")
    assert "ok: results match numpy" in out


@pytest.mark.timeout(300)
@pytest.mark.skipif(
    importlib.util.find_spec("starlette") is None or importlib.util.find_spec("fastapi") is None,
    reason="Ray Serve is not installed (pip install 'ray[serve]')",
)
def test_serve_example() -> None:
    out = run_example("ray_serve.py")
    assert "ok: every answer matches numpy" in out
