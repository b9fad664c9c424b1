"""The Ray examples run from the source tree as a user would run them (each starts and
ends its own local Ray), on the simulated backend and, where there is one, on the GPU."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest

from ..conftest import real_gpu_count
from .conftest import ROOT


def _serve_installed() -> bool:
    """Whether Ray Serve and everything it imports are there (Ray alone is not enough)."""
    try:
        with warnings.catch_warnings():  # its own deprecation warnings, not ours to see
            warnings.simplefilter("ignore")
            import ray.serve  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(
    params=[
        pytest.param("sim", id="sim"),
        pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
    ]
)
def example_backend(request: pytest.FixtureRequest) -> str:
    """The backend the example runs on (``AIOCUDA_BACKEND``, which its actors inherit)."""
    if request.param == "cuda" and real_gpu_count() == 0:
        pytest.skip("no real GPU")
    return str(request.param)


def run_example(name: str, backend: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    # Ray Serve kills its HTTP proxy after three 5 s readiness checks: on a loaded 2-core
    # CI machine that happened before it was up (serve.start then raised ActorDiedError).
    env["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] = "120"
    env["RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S"] = "120"
    env["AIOCUDA_BACKEND"] = backend
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
def test_pipeline_example(example_backend: str) -> None:
    out = run_example("ray_pipeline.py", example_backend)
    assert "ok: results match numpy" in out


@pytest.mark.timeout(300)
@pytest.mark.skipif(not _serve_installed(), reason="Ray Serve is not installed (pip install 'ray[serve]')")
def test_serve_example(example_backend: str) -> None:
    out = run_example("ray_serve.py", example_backend)
    assert "ok: every answer matches numpy" in out
