"""Devices, backend selection and the typed errors of the foundation."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

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

from ._control import forked_outcomes

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
    assert Device(np.int64(0)) is Device(0)  # numpy's integers are ordinals
    for wrong in (0.0, False, ""):  # (falsy, and read as device 0)
        with pytest.raises(TypeError, match="must be an int"):
            aiocuda.Stream(wrong)  # type: ignore[arg-type]


def test_unknown_attribute_is_a_typed_error(backend: _driver.Driver) -> None:
    with pytest.raises(ArgumentError, match="no_such_attribute"):
        Device(0).attribute("no_such_attribute")


def _pci_forms(bus_id: str) -> list[str]:
    """``bus_id`` (``domain:bus:device.function``) as people and tools write it."""
    domain, bus, rest = bus_id.split(":")
    device, function = rest.split(".")
    full = f"{int(domain, 16):04x}:{bus}:{device}.{function}"
    forms = [bus_id, full.upper(), full.lower(), f"{int(domain, 16):08X}:{bus}:{device}.{function}"]  # nvidia-smi
    if function == "0":
        forms.append(f"{domain}:{bus}:{device}")  # no function: function 0
    if int(domain, 16) == 0:
        forms.append(f"{bus}:{device}.{function}")  # no domain: domain 0
    return forms


def _uuid_forms(uuid: str) -> list[str]:
    """``uuid`` (``GPU-8-4-4-4-12``) as people and tools write it."""
    bare = uuid.removeprefix("GPU-")
    digits = bare.replace("-", "")
    return [uuid, uuid.upper(), "gpu-" + bare, bare, bare.upper(), digits, "GPU-" + digits.upper()]


def test_devices_are_found_by_pci_bus_id_and_uuid(backend: _driver.Driver) -> None:
    found = devices()
    assert len({d.pci_bus_id.lower() for d in found}) == len({d.uuid for d in found}) == len(found)
    for device in found:
        for form in _pci_forms(device.pci_bus_id):
            assert Device.from_pci_bus_id(form) is device, form
        for form in _uuid_forms(device.uuid):
            assert Device.from_uuid(form) is device, form


def test_simulated_bus_ids_with_hex_letters_in_either_case() -> None:
    _driver.use_backend("sim", devices=12)
    assert Device(10).pci_bus_id == "0000:0a:00.0"
    assert Device.from_pci_bus_id("0000:0A:00.0") is Device.from_pci_bus_id("0a:00.0") is Device(10)
    assert Device.from_pci_bus_id("0000:0b:00") is Device(11)
    assert len({d.uuid for d in devices()}) == 12


@given(
    domain=st.integers(0, 0xFFFF_FFFF),
    bus=st.integers(0, 0xFF),
    device=st.integers(0, 0xFF),
    function=st.integers(0, 7),
)
def test_pci_bus_ids_parse_in_every_form_the_driver_reads(domain: int, bus: int, device: int, function: int) -> None:
    parsed = _driver.parse_pci_bus_id(f"{domain:08X}:{bus:02X}:{device:02X}.{function}")
    if device > 0x1F:  # (5 bits)
        assert parsed is None
        return
    assert parsed == _driver.PciBusId(domain, bus, device, function)
    assert _driver.parse_pci_bus_id(str(parsed)) == parsed == _driver.parse_pci_bus_id(str(parsed).upper())
    assert str(parsed).startswith(f"{domain:04x}:{bus:02x}:{device:02x}.{function}")
    if function == 0:
        assert _driver.parse_pci_bus_id(f"{domain:x}:{bus:x}:{device:x}") == parsed
    if domain == 0:
        assert _driver.parse_pci_bus_id(f"{bus:02x}:{device:02x}.{function}") == parsed


@pytest.mark.parametrize(
    "bus_id",
    ["", "17", "17:00", "0000:17:00.8", "0000:17:20.0", "0000:117:00.0", "000000000:17:00.0", "0000:17:00.0x",
     " 0000:17:00.0", "0000-17-00.0", "GPU-8f3c2a1e-0b4d-4c1e-9a57-a10c0da51a70"],
)  # fmt: skip
def test_a_malformed_pci_bus_id_is_an_argument_error_listing_the_devices(backend: _driver.Driver, bus_id: str) -> None:
    with pytest.raises(ArgumentError, match="is not a PCI bus id") as info:
        Device.from_pci_bus_id(bus_id)
    assert info.value.code == ResultCode.INVALID_VALUE and info.value.name == "CUDA_ERROR_INVALID_VALUE"
    assert repr(bus_id) in str(info.value) and "'0000:17:00.0'" in str(info.value)  # what was wrong, and the form
    assert all(d.pci_bus_id in str(info.value) for d in devices())


@pytest.mark.parametrize(
    "uuid",
    ["", "GPU-", "GPU-8f3c2a1e", "GPU-8f3c2a1e-0b4d-4c1e-9a57-a10c0da51a7", "GPU-8f3c2a1e0b4d-4c1e-9a57-a10c0da51a70",
     "GPU-8f3c2a1e-0b4d-4c1e-9a57-a10c0da51a7g", "GPU-GPU-8f3c2a1e-0b4d-4c1e-9a57-a10c0da51a70", "0000:17:00.0"],
)  # fmt: skip
def test_a_malformed_uuid_is_an_argument_error_listing_the_devices(backend: _driver.Driver, uuid: str) -> None:
    with pytest.raises(ArgumentError, match="is not a GPU UUID") as info:
        Device.from_uuid(uuid)
    assert info.value.code == ResultCode.INVALID_VALUE
    assert repr(uuid) in str(info.value) and all(d.uuid in str(info.value) for d in devices())


def test_a_mig_uuid_says_how_to_use_the_instance(backend: _driver.Driver) -> None:
    for mig in ("MIG-8f3c2a1e-0b4d-4c1e-9a57-a10c0da51a70", "mig-GPU-8f3c2a1e-0b4d-4c1e-9a57-a10c0da51a70/1/0"):
        with pytest.raises(ArgumentError, match="MIG instance") as info:
            Device.from_uuid(mig)
        assert info.value.code == ResultCode.INVALID_VALUE and "CUDA_VISIBLE_DEVICES=MIG-" in str(info.value)


def test_an_id_no_device_has_names_the_visible_ones(backend: _driver.Driver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    # Domain 0xfffe: no machine puts a GPU there (the driver is asked, and finds none).
    with pytest.raises(ArgumentError, match=r"no visible device has PCI bus id fffe:ff:1f\.7\.") as info:
        Device.from_pci_bus_id("FFFE:FF:1F.7")
    assert info.value.code == ResultCode.INVALID_DEVICE and info.value.name == "CUDA_ERROR_INVALID_DEVICE"
    assert all(d.pci_bus_id in str(info.value) and d.uuid in str(info.value) for d in devices())
    missing = "GPU-00000000-0000-0000-0000-000000000000"
    with pytest.raises(ArgumentError, match=f"no visible device has UUID {missing}") as info:
        Device.from_uuid("gpu-" + "0" * 32)
    assert info.value.code == ResultCode.INVALID_DEVICE
    assert all(d.uuid in str(info.value) for d in devices())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # (read for the message only)
    with pytest.raises(ArgumentError, match="CUDA_VISIBLE_DEVICES=0 chooses which are visible"):
        Device.from_uuid(missing)


def test_ids_must_be_strings_and_an_ordinal_is_not_one(backend: _driver.Driver) -> None:
    with pytest.raises(TypeError, match="a PCI bus id must be a str, not bytes"):
        Device.from_pci_bus_id(b"0000:17:00.0")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="a GPU UUID must be a str, not int"):
        Device.from_uuid(0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"Device\.from_pci_bus_id\(\) or Device\.from_uuid\(\)"):
        Device(Device(0).pci_bus_id)  # type: ignore[arg-type]


def test_peer_access_between_simulated_devices(sim_backend: _driver.Driver) -> None:
    a, b = Device(0), Device(1)
    assert a.can_access_peer(b) and not a.can_access_peer(a)
    assert a.can_access_peer(1) and a.peer_attributes(1).access_supported  # an ordinal will do
    assert a.enable_peer_access(b) is True
    assert a.enable_peer_access(b) is False  # idempotent: on already
    with pytest.raises(ArgumentError):
        a.enable_peer_access(a)
    a.disable_peer_access(b)
    with pytest.raises(CudaError) as info:
        a.disable_peer_access(b)
    assert info.value.code == ResultCode.PEER_ACCESS_NOT_ENABLED


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


FALLBACK_SCRIPT = """
import logging, sys, warnings
import aiocuda
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record)
logging.getLogger("aiocuda").addHandler(Keep())
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    backend = aiocuda.current_backend()
print(backend.name, backend.requested, backend.simulated, backend.device_count, bool(backend.fallback_reason))
print([type(w.message).__name__ for w in caught], caught[0].filename)
print([r.levelname for r in records if r.levelno >= logging.WARNING])
"""


def test_auto_falls_back_to_sim_with_a_warning_and_a_log_record() -> None:
    proc = run_python(FALLBACK_SCRIPT, AIOCUDA_BACKEND="auto", CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "sim auto True 2 True"
    assert lines[1] == "['SimulatedBackendWarning'] <string>"  # points at the caller, not at aiocuda
    assert lines[2] == "['WARNING']"


def test_the_fallback_warning_shows_once_in_one_line_without_logging_configured() -> None:
    proc = run_python("import aiocuda; aiocuda.devices(); aiocuda.Stream()", CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("SimulatedBackendWarning") == 1
    assert "no usable GPU" in proc.stderr and "AIOCUDA_BACKEND=cuda" in proc.stderr


def test_the_fallback_warning_as_an_error_means_no_device_error() -> None:
    proc = run_python(
        "import warnings, aiocuda\n"
        "warnings.simplefilter('error', aiocuda.SimulatedBackendWarning)\n"
        "try:\n    aiocuda.devices()\n"
        "except aiocuda.NoDeviceError as e:\n    print('NODEVICE')\n",
        CUDA_VISIBLE_DEVICES="",
    )
    assert proc.stdout.strip() == "NODEVICE", proc.stderr


def test_must_have_a_gpu_is_one_setting() -> None:
    proc = run_python(
        "import aiocuda\ntry:\n    aiocuda.devices()\nexcept aiocuda.NoDeviceError as e:\n    print('NODEVICE')\n",
        AIOCUDA_BACKEND="cuda",
        CUDA_VISIBLE_DEVICES="",
    )
    assert proc.stdout.strip() == "NODEVICE", proc.stderr
    assert "SimulatedBackendWarning" not in proc.stderr


def test_current_backend_describes_the_choice(backend: _driver.Driver) -> None:
    info = aiocuda.current_backend()
    assert info.name == backend.name and info.simulated == (backend.name == "sim")
    assert info.device_count == device_count()
    assert info.fallback_reason is None  # chosen explicitly
    assert info.driver_version[0] >= 12


def test_use_backend_returns_a_description_not_the_driver() -> None:
    chosen = aiocuda.use_backend("sim", devices=3)
    assert chosen == aiocuda.current_backend()
    assert (chosen.name, chosen.requested, chosen.device_count) == ("sim", "sim", 3)
    assert isinstance(chosen, aiocuda.Backend)


@pytest.mark.parametrize("value", ["abc", "0", "-1", "1.5"])
def test_a_bad_sim_device_count_names_the_variable(value: str) -> None:
    proc = run_python("import aiocuda; aiocuda.devices()", AIOCUDA_BACKEND="sim", AIOCUDA_SIM_DEVICES=value)
    assert proc.returncode != 0
    assert "AIOCUDA_SIM_DEVICES must be a positive whole number" in proc.stderr and repr(value) in proc.stderr


def test_the_simulator_has_two_devices_unless_told() -> None:
    env = {k: v for k, v in os.environ.items() if k != "AIOCUDA_SIM_DEVICES"}
    proc = subprocess.run(
        [sys.executable, "-c", "import aiocuda; print(aiocuda.device_count())"],
        env={**env, "AIOCUDA_BACKEND": "sim", "PYTHONPATH": SRC},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.stdout.strip() == "2", proc.stderr


def test_any_call_on_a_poisoned_context_fails(sim_backend: _driver.Driver) -> None:
    s = Stream(0)
    sim_backend.poison(0)  # type: ignore[attr-defined]
    for call in (s.record, s.synchronize, lambda: Stream(0), s.query):
        with pytest.raises(ContextPoisonedError) as info:
            call()
        assert info.value.code == ResultCode.ILLEGAL_ADDRESS
    with pytest.raises(ContextPoisonedError, match="sticky error on device 0"):
        Stream(1)  # another device too: as on GPUs, a sticky error ends the process's use of CUDA


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
    [message] = forked_outcomes(lambda: Stream(0))
    assert "forked" in message and "spawn" in message, message


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_before_any_use_runs_gpu_work() -> None:
    # A pre-forking server's master (gunicorn --preload) imports the app, and with it
    # aiocuda, then forks its workers: each makes its own backend.
    code = """
import os, anyio, numpy as np, aiocuda
pid = os.fork()
if pid == 0:
    async def request() -> None:
        async with aiocuda.Lanes(count=1) as lanes, lanes.lease() as lane:
            result = lane.download(lane.upload(np.arange(4, dtype=np.float32)))
            await lane
        assert (result == np.arange(4)).all(), result
    anyio.run(request)
    os._exit(0)
_, status = os.waitpid(pid, 0)
print("child exit", os.waitstatus_to_exitcode(status))
"""
    proc = run_python(code, AIOCUDA_BACKEND="sim")
    assert proc.returncode == 0, proc.stderr
    assert "child exit 0" in proc.stdout, proc.stdout + proc.stderr


def test_info_command_lists_devices() -> None:
    proc = run_python(
        "import sys; from aiocuda.__main__ import main; sys.exit(main(['info']))",
        AIOCUDA_BACKEND="sim",
        AIOCUDA_SIM_DEVICES="2",
    )
    assert proc.returncode == 0, proc.stderr
    assert "backend: sim" in proc.stdout and "simulated" in proc.stdout
    assert "device 1:" in proc.stdout and "compute capability" in proc.stdout
