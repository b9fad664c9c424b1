"""The command line as a user meets it: one-line failures, exit codes, Ctrl-C, pipes, help.

Each test runs ``python -m aiocuda`` in a subprocess, as a user would.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIOCUDA_")}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.update(extra)
    return env


def aiocuda(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aiocuda", *args], env=_env(**env), capture_output=True, text=True, timeout=120
    )


def assert_one_line_failure(done: subprocess.CompletedProcess[str], code: int, *words: str) -> None:
    assert done.returncode == code, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1, done.stderr
    for word in words:
        assert word in errors[0], done.stderr


# -- expected failures: one line, the right exit code, nothing printed before ---------------------
def test_no_gpu_where_one_is_required_is_one_line() -> None:
    done = aiocuda("info", AIOCUDA_BACKEND="cuda", CUDA_VISIBLE_DEVICES="")
    assert_one_line_failure(done, 1, "python -m aiocuda info: error:", "AIOCUDA_BACKEND=sim")
    assert done.stdout == ""


def test_a_bad_sim_device_count_names_the_variable() -> None:
    done = aiocuda("info", AIOCUDA_BACKEND="sim", AIOCUDA_SIM_DEVICES="abc")
    assert_one_line_failure(done, 2, "AIOCUDA_SIM_DEVICES", "'abc'")


def test_an_unknown_backend_is_a_usage_error() -> None:
    done = aiocuda("info", AIOCUDA_BACKEND="rocm")
    assert_one_line_failure(done, 2, "'rocm'", "cuda, sim, auto")


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--trace", "/nonexistent/x.json"], ["--trace", "/nonexistent does not exist"]),
        (["--chunks", "0"], ["--chunks", "above 0"]),
        (["--chunk-mib", "-1"], ["--chunk-mib", "above 0"]),
        (["--chunk-mib", "0.000001"], ["--chunk-mib", "at least one float32"]),
        (["--chunk-mib", "1e9"], ["--chunk-mib 1e+09:", "GiB of host memory"]),
        (["--devices", "99"], ["--devices 99", "has 2 device(s)"]),
    ],
)
def test_demo_checks_its_arguments_before_it_starts(args: list[str], words: list[str]) -> None:
    done = aiocuda("demo", *args, AIOCUDA_BACKEND="sim")
    assert_one_line_failure(done, 2, *words)
    assert done.stdout == ""  # no banner
    assert done.stderr.startswith("usage: python -m aiocuda demo")


@pytest.mark.parametrize("command", ["info", "demo", "bench"])
def test_an_unknown_argument_is_told_with_its_commands_usage(command: str) -> None:
    done = aiocuda(command, "--bogus", AIOCUDA_BACKEND="sim")
    assert_one_line_failure(done, 2, f"python -m aiocuda {command}: error:", "unrecognized arguments: --bogus")
    assert done.stderr.startswith(f"usage: python -m aiocuda {command}")
    assert done.stdout == ""


def test_a_closed_output_pipe_ends_quietly() -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line, as `| head -0` would be
    try:
        done = subprocess.run(
            [sys.executable, "-m", "aiocuda", "info"],
            env=_env(AIOCUDA_BACKEND="sim"),
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert done.returncode == 141
    assert done.stderr == ""


BACKENDS = [pytest.param("sim", id="sim"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def _needs(backend: str) -> None:
    from .conftest import real_gpu_count

    if backend == "cuda" and real_gpu_count() == 0:
        pytest.skip("no real GPU")


@pytest.mark.parametrize("backend", BACKENDS)
def test_ctrl_c_during_the_demo_ends_it_at_once_in_one_line(backend: str, tmp_path: pathlib.Path) -> None:
    _needs(backend)
    trace = tmp_path / "trace.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "aiocuda", "demo", "--chunks", "20000", "--chunk-mib", "0.001", "--trace", str(trace)],
        env=_env(AIOCUDA_BACKEND=backend),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        for line in proc.stdout:
            if "chunks of" in line:  # the pipeline is starting: Ctrl-C now
                break
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert err.splitlines() == ["python -m aiocuda demo: interrupted"]
    assert not trace.exists() or json.loads(trace.read_text())["traceEvents"]  # complete or absent
    assert not list(tmp_path.glob(".*partial"))


# -- what a user asks of a command line -----------------------------------------------------------
def test_version() -> None:
    done = aiocuda("--version")
    assert done.returncode == 0 and done.stdout.startswith("aiocuda 0.")


@pytest.mark.gpu
def test_info_as_json_on_the_gpu() -> None:
    _needs("cuda")
    done = aiocuda("info", "--json", AIOCUDA_BACKEND="cuda")
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert document["backend"]["name"] == "cuda" and document["backend"]["simulated"] is False
    assert len(document["devices"]) == document["backend"]["device_count"] >= 1
    assert document["devices"][0]["compute_capability"][0] >= 7


def test_info_as_json() -> None:
    done = aiocuda("info", "--json", AIOCUDA_BACKEND="sim", AIOCUDA_SIM_DEVICES="3")
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert document["backend"]["name"] == "sim" and document["backend"]["simulated"] is True
    assert [d["ordinal"] for d in document["devices"]] == [0, 1, 2]
    assert document["devices"][0]["peer_access"] == [1, 2]


def test_info_and_demo_agree_on_the_simulated_device_count(tmp_path: pathlib.Path) -> None:
    shown = aiocuda("info", AIOCUDA_BACKEND="sim")
    used = aiocuda(
        "demo", "--chunks", "2", "--chunk-mib", "0.01", "--trace", str(tmp_path / "t.json"), AIOCUDA_BACKEND="sim"
    )
    assert shown.returncode == 0 and used.returncode == 0, shown.stderr + used.stderr
    assert "2 devices" in shown.stdout and "device 1:" in shown.stdout and "device 2:" not in shown.stdout
    assert "2 simulated devices" in used.stdout


def test_help_names_the_command_as_run_and_has_no_markup() -> None:
    as_module = aiocuda("--help")
    assert as_module.returncode == 0 and as_module.stdout.startswith("usage: python -m aiocuda ")
    as_script = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.argv[0] = '/usr/local/bin/aiocuda'; "
            "from aiocuda.__main__ import main; sys.exit(main(['--help']))",
        ],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert as_script.returncode == 0 and as_script.stdout.startswith("usage: aiocuda ")
    for command in ("info", "demo", "bench"):
        text = aiocuda(command, "--help").stdout
        assert "``" not in text and ":mod:" not in text, text


def test_bench_lists_the_benchmarks() -> None:
    listed = aiocuda("bench", "--help").stdout
    for name in ("await_latency", "launch", "memory", "pipeline"):
        assert f"\n  {name} " in listed
    done = aiocuda("bench", "nosuch")
    assert_one_line_failure(done, 2, "no benchmark named 'nosuch'", "await_latency", "pipeline")


def test_bench_on_the_simulator_says_that_nothing_is_kept(
    sim_backend: object, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    from aiocuda._cli import bench
    from aiocuda._cli.main import main

    (tmp_path / "tiny.py").write_text('"""A tiny benchmark."""\nimport sys\nprint("ARGS", sys.argv[1:])\n')
    monkeypatch.setattr(bench, "_ROOT", tmp_path)
    for args, passed_on in ((["--quick", "tiny"], "['--quick']"), (["tiny"], "[]")):
        assert main(["bench", *args]) == 0
        out = capfd.readouterr().out
        assert "on the SIMULATED backend (no GPU): figures to look at, not to keep" in out
        assert "nothing is written to benchmarks/results/" in out
        assert f"ARGS {passed_on}" in out


def test_a_demo_trace_that_cannot_be_written_is_one_line_naming_it(
    sim_backend: object, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """The demo had Trace.write_chrome write its temporary file, which wrote its own
    inside it: a failed write named ``..trace.json.<pid>.partial.<pid>.<thread>.partial``,
    and a Ctrl-C during the write left that inner file (the handler removes the outer)."""
    from aiocuda._cli.main import main

    trace = tmp_path / "trace.json"
    written: list[str] = []

    def full_disk(self: pathlib.Path, text: str, *args: object, **kwargs: object) -> int:
        written.append(self.name)
        with self.open("w") as f:
            f.write(text[: len(text) // 2])
        raise OSError(28, "No space left on device", str(self))

    monkeypatch.setattr(pathlib.Path, "write_text", full_disk)
    assert main(["demo", "--chunks", "2", "--trace", str(trace)]) == 1
    err = capfd.readouterr().err
    assert f"demo: error: No space left on device: {trace}\n" in err and "partial" not in err, err
    assert written == [f".trace.json.{os.getpid()}.partial"]  # the name Ctrl-C's handler removes
    assert list(tmp_path.iterdir()) == []
