"""Fixtures of the driver tests: the simulated driver, in use or on its own."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from aiocuda._driver.sim import SimDriver


@pytest.fixture
def sim(sim_backend: Any) -> SimDriver:
    """The simulated backend in use (``use_backend("sim", devices=2)``)."""
    assert isinstance(sim_backend, SimDriver)
    return sim_backend


@pytest.fixture
def fresh() -> Iterator[SimDriver]:
    """A SimDriver outside ``use_backend`` (for thread accounting and odd configurations)."""
    driver = SimDriver(devices=2)
    driver.init()
    yield driver
    driver.shutdown()
