"""The GPU lane of the test suite: asked for, a missing GPU fails the run; not asked for, it skips.

Each case runs pytest in a subprocess on a small test file beside a copy of this suite's
``conftest.py``, with ``CUDA_VISIBLE_DEVICES`` empty, so that the driver finds no GPU
here and on the GPU machine alike.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

TESTS = pathlib.Path(__file__).resolve().parent

LANE_TESTS = """
import pytest
from conftest import real_gpu_count


def test_on_every_backend(backend):
    assert backend.name in ("sim", "cuda")


def test_on_the_real_driver(cuda_backend):
    assert cuda_backend.name == "cuda"


@pytest.mark.gpu
def test_that_probes_by_itself():
    if real_gpu_count() == 0:
        pytest.skip("no real GPU")
"""


def _pytest(tmp_path: pathlib.Path, *args: str, backend: str | None = None) -> subprocess.CompletedProcess[str]:
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_lane.py").write_text(LANE_TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: real GPU\n    multi_gpu: two GPUs\n")
    env = {k: v for k, v in os.environ.items() if k not in ("AIOCUDA_BACKEND", "PYTEST_ADDOPTS")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    if backend is not None:
        env["AIOCUDA_BACKEND"] = backend
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", str(tmp_path), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_without_the_lane_a_missing_gpu_skips(tmp_path: pathlib.Path) -> None:
    done = _pytest(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed, 3 skipped" in done.stdout, done.stdout
    assert "no real GPU" in done.stdout


@pytest.mark.parametrize(
    ("args", "backend"), [(("--require-gpu",), None), ((), "cuda")], ids=["--require-gpu", "AIOCUDA_BACKEND=cuda"]
)
def test_in_the_lane_a_missing_gpu_fails(tmp_path: pathlib.Path, args: tuple[str, ...], backend: str | None) -> None:
    done = _pytest(tmp_path, *args, backend=backend)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 passed" in done.stdout and "skipped" not in done.stdout, done.stdout
    # The cuda instance of the backend test, the cuda_backend test, the self-probing test:
    assert done.stdout.count("the GPU lane needs a real GPU") >= 3, done.stdout
    assert "no gpu test passed" in done.stdout


def test_in_the_lane_a_run_without_a_gpu_test_fails(tmp_path: pathlib.Path) -> None:
    """Every selected test passed, but none of them on a GPU: the lane fails."""
    done = _pytest(tmp_path, "--require-gpu", "-m", "not gpu")
    assert "1 passed" in done.stdout, done.stdout
    assert done.returncode == 1, done.stdout + done.stderr
    assert "0 gpu tests passed: the GPU lane was asked for and no gpu test passed" in done.stdout
