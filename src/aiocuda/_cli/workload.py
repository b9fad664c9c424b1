"""The ``scale`` workload of the demo, ``benchmarks/pipeline.py`` and the tests: a kernel,
its simulated implementation, the numpy reference, and a pipeline stage running it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from ..array import DeviceArray
from ..executor import ChunkContext
from ..kernel import Kernel, register_sim_kernel
from ..program import Program

__all__ = ["SCALE_SOURCE", "ScaleStage", "scale_reference"]

SCALE_SOURCE = r"""
extern "C" __global__ void scale(float* x, int n, int reps) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float v = x[i];
        for (int r = 0; r < reps; r++) v = v * 1.000001f + 0.5f;
        x[i] = v;
    }
}
"""
"""The reference pipeline's kernel (``../shared/reference/anchor_probe.py``): ``reps``
dependent multiply-adds per element, so its length is set by ``reps``."""

_A = float(np.float32(1.000001))
_BLOCK = 256


def scale_reference(x: npt.NDArray[np.float32], reps: int) -> npt.NDArray[np.float32]:
    """What ``scale`` computes, in closed form (float64, then float32): ``v -> a v + b``
    ``reps`` times is ``a^reps v + b (a^reps - 1) / (a - 1)``. The GPU's float32 loop
    differs by rounding, about ``reps * 2**-24`` relative: compare with ``rtol=1e-3``."""
    power = _A**reps
    return (x.astype(np.float64) * power + 0.5 * (power - 1.0) / (_A - 1.0)).astype(np.float32)


def _sim_scale(launch: Any, x: npt.NDArray[np.float32], n: np.int32, reps: np.int32) -> None:
    view = x[: int(n)]
    view[:] = scale_reference(view, int(reps))


class ScaleStage:
    """A pipeline stage running ``scale`` in place on each chunk (one launch per chunk).

    Compiles once (NVRTC on a GPU, cached on disk; on the simulator the kernel runs as
    numpy through a registered implementation); modules load lazily per device.
    """

    def __init__(self, reps: int) -> None:
        register_sim_kernel("scale", _sim_scale)
        self.reps = reps
        self.kernel: Kernel = Program(SCALE_SOURCE, name="scale.cu").compile().kernel("scale")
        self.__name__ = f"scale x{reps}"

    def __call__(self, ctx: ChunkContext, x: DeviceArray) -> None:
        n = x.size
        self.kernel.launch((n + _BLOCK - 1) // _BLOCK, _BLOCK, x, n, self.reps, stream=ctx.stream)
