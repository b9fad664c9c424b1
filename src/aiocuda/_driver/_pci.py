"""PCI bus ids in the forms ``cuDeviceGetByPCIBusId`` reads, parsed and checked.

The driver accepts three forms, every field hexadecimal (either case):

* ``domain:bus:device.function`` -- what ``cuDeviceGetPCIBusId`` prints
  (``"0000:17:00.0"``); nvidia-smi and NVML print the domain with eight digits
  (``"00000000:17:00.0"``);
* ``domain:bus:device`` -- function 0;
* ``bus:device.function`` -- domain 0.

Both backends read ids with :func:`parse_pci_bus_id`, so a lookup matches the same
strings on either, and aiocuda hands the real driver only well-formed ids.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["PCI_BUS_ID_FORMS", "PciBusId", "parse_pci_bus_id"]

PCI_BUS_ID_FORMS = (
    "domain:bus:device.function in hexadecimal ('0000:17:00.0'), or domain:bus:device ('0000:17:00') "
    "or bus:device.function ('17:00.0')"
)
"""The accepted forms, as error messages name them."""

# Field widths are the PCI limits: a 32-bit domain (NVML prints eight digits), an 8-bit
# bus, a 5-bit device and a 3-bit function; the device and function ranges are checked
# after the match. A form with neither domain nor function ("17:00") is not one the
# driver documents, and would read as domain:bus to some tools and bus:device to others.
_FORM = re.compile(
    r"(?:(?P<domain>[0-9a-f]{1,8}):)?(?P<bus>[0-9a-f]{1,2}):(?P<device>[0-9a-f]{1,2})(?:\.(?P<function>[0-7]))?",
    re.IGNORECASE | re.ASCII,
)
_MAX_DEVICE = 0x1F


@dataclass(frozen=True, slots=True)
class PciBusId:
    """One PCI address. ``str()`` gives the driver's ``domain:bus:device.function``
    form, in lowercase as Linux names the device (``/sys/bus/pci/devices/0000:17:00.0``)."""

    domain: int
    bus: int
    device: int
    function: int

    def __str__(self) -> str:
        return f"{self.domain:04x}:{self.bus:02x}:{self.device:02x}.{self.function:x}"


def parse_pci_bus_id(text: str) -> PciBusId | None:
    """The address ``text`` names in one of the driver's forms (see the module
    docstring); ``None`` when it is in none of them or its device number is above 0x1f."""
    match = _FORM.fullmatch(text)
    if match is None:
        return None
    domain, function = match["domain"], match["function"]
    if domain is None and function is None:
        return None
    parsed = PciBusId(
        domain=int(domain or "0", 16),
        bus=int(match["bus"], 16),
        device=int(match["device"], 16),
        function=int(function or "0", 16),
    )
    return parsed if parsed.device <= _MAX_DEVICE else None
