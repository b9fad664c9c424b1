"""Devices, backend selection and the typed errors of the foundation."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

import aiocuda
from aiocuda import _driver
from aiocuda.device import Device, DeviceProperties, device_count, devices
from aiocuda.errors import (
    ArgumentError,
    BackendError,
    ContextPoisonedError,
    CudaError,
    NoDeviceError,
    OutOfMemoryError,
    ResultCode,
    error_for_code,
)
from aiocuda.stream import Stream

SRC = str(pathlib.Path(__file__).resolve().parents[1] / "src")


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, *inherited]), **env}
    return subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=60)


def test_devices_are_singletons_with_attributes(backend: _driver.Driver) -> None:
    assert device_count() >= 1
    dev = Device(0)
    assert Device(0) is dev and devices()[0] is dev
    assert re.fullmatch(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", dev.uuid)
    assert dev.total_memory > 0
    major, minor = dev.compute_capability
    assert major >= 3 and minor >= 0
    props = dev.properties()
    assert isinstance(props, DeviceProperties)
    assert props.warp_size == 32 and props.max_threads_per_block >= 256
    assert props.memory_pools_supported
    attrs = dev.attributes()
    assert attrs["multiprocessor_count"] == dev.multiprocessor_count
    free, total = dev.memory_info()
    assert 0 < free <= total
    assert repr(dev).startswith("<Device 0:")


def test_out_of_range_ordinal_is_a_typed_error(backend: _driver.Driver) -> None:
    with pytest.raises(ArgumentError) as info:
        Device(device_count() + 5)
    assert info.value.code == ResultCode.INVALID_DEVICE
    assert str(device_count() + 5) in str(info.value)
    with pytest.raises(TypeError):
        Device("0")  # type: ignore[arg-type]


def test_unknown_attribute_is_a_typed_error(backend: _driver.Driver) -> None:
    with pytest.raises(ArgumentError, match="no_such_attribute"):
        Device(0).attribute("no_such_attribute")


def test_peer_access_between_simulated_devices(sim_backend: _driver.Driver) -> None:
    a, b = Device(0), Device(1)
    assert a.can_access_peer(b) and not a.can_access_peer(a)
    a.enable_peer_access(b)
    a.enable_peer_access(b)  # idempotent
    with pytest.raises(ArgumentError):
        a.enable_peer_access(a)


def test_unknown_backend_name() -> None:
    with pytest.raises(BackendError, match="choose one of cuda, sim, auto") as info:
        aiocuda.use_backend("rocm")
    assert isinstance(info.value, aiocuda.CudaError) and isinstance(info.value, ValueError)
    proc = run_python("import aiocuda.device as d; d.devices()", AIOCUDA_BACKEND="opencl")
    assert proc.returncode != 0 and "BackendError" in proc.stderr and "opencl" in proc.stderr


def test_missing_driver_or_device_says_what_to_do() -> None:
    """No driver (this CI machine) or no visible device (CUDA_VISIBLE_DEVICES empty)."""
    proc = run_python(
        "import aiocuda\n"
        "try:\n    aiocuda.use_backend('cuda')\n"
        "except aiocuda.NoDeviceError as e:\n    print('NODEVICE', e)\n",
        CUDA_VISIBLE_DEVICES="",
    )
    assert "NODEVICE" in proc.stdout, proc.stderr
    assert "AIOCUDA_BACKEND=sim" in proc.stdout


def test_auto_falls_back_to_sim_with_a_notice() -> None:
    proc = run_python(
        "from aiocuda import _driver; print(_driver.driver().name)", AIOCUDA_BACKEND="auto", CUDA_VISIBLE_DEVICES=""
    )
    assert proc.stdout.strip() == "sim"
    assert "using the simulated backend" in proc.stderr


def test_any_call_on_a_poisoned_context_fails(sim_backend: _driver.Driver) -> None:
    s = Stream(0)
    sim_backend.poison(0)  # type: ignore[attr-defined]
    for call in (s.record, s.synchronize, lambda: Stream(0), s.query):
        with pytest.raises(ContextPoisonedError) as info:
            call()
        assert info.value.code == ResultCode.ILLEGAL_ADDRESS
    with Stream(1) as healthy:  # another device is unaffected
        healthy.synchronize()


def test_error_classes_follow_result_codes() -> None:
    assert isinstance(error_for_code(2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"), OutOfMemoryError)
    assert isinstance(error_for_code(2, "x", ""), MemoryError)
    assert isinstance(error_for_code(700, "CUDA_ERROR_ILLEGAL_ADDRESS", ""), ContextPoisonedError)
    assert isinstance(error_for_code(100, "CUDA_ERROR_NO_DEVICE", ""), NoDeviceError)
    assert isinstance(error_for_code(1, "CUDA_ERROR_INVALID_VALUE", ""), ValueError)
    generic = error_for_code(12345, "CUDA_ERROR_SOMETHING", "why", "cuFoo")
    assert type(generic) is CudaError
    assert (generic.code, generic.name, generic.description, generic.call) == (
        12345,
        "CUDA_ERROR_SOMETHING",
        "why",
        "cuFoo",
    )
    assert "cuFoo" in str(generic) and "why" in str(generic)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_fork_child_gets_a_clear_error(backend: _driver.Driver) -> None:
    Stream(0).synchronize()  # the parent has used the driver
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: report what using the GPU does, then leave without cleanup
        try:
            Stream(0)
            message = b"no error"
        except NoDeviceError as exc:
            message = str(exc).encode()
        except BaseException as exc:
            message = f"wrong error {type(exc).__name__}: {exc}".encode()
        os.write(write_end, message)
        os._exit(0)
    os.close(write_end)
    _, status = os.waitpid(pid, 0)
    message = os.read(read_end, 4096).decode()
    os.close(read_end)
    assert status == 0
    assert "forked" in message and "spawn" in message, message


def test_info_command_lists_devices() -> None:
    proc = run_python(
        "import sys; from aiocuda.__main__ import main; sys.exit(main(['info']))",
        AIOCUDA_BACKEND="sim",
        AIOCUDA_SIM_DEVICES="2",
    )
    assert proc.returncode == 0, proc.stderr
    assert "backend: sim" in proc.stdout and "simulated" in proc.stdout
    assert "device 1:" in proc.stdout and "compute capability" in proc.stdout
