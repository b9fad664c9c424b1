"""Rebuild ``fill.fatbin``: the ``fill`` kernel as an sm_90 cubin in a fatbin container.

    python tests/data/make_fill_fatbin.py

Needs NVRTC and libnvfatbin (``pip install nvidia-cuda-nvrtc nvidia-nvfatbin``) and
cuda-bindings; no GPU. The committed file was made with NVRTC 13.0 (so that any CUDA 13
driver loads it) and nvfatbin 13.4.
"""

import pathlib

from cuda.bindings import nvfatbin, nvrtc

SOURCE = b"""extern "C" __global__ void fill(int* out, int value, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = value;
}
"""


def cubin(arch: str) -> bytes:
    err, program = nvrtc.nvrtcCreateProgram(SOURCE, b"fill.cu", 0, [], [])
    options = [f"-arch={arch}".encode()]
    (err,) = nvrtc.nvrtcCompileProgram(program, len(options), options)
    if err:
        raise RuntimeError(f"nvrtcCompileProgram: {err}")
    err, size = nvrtc.nvrtcGetCUBINSize(program)
    image = b" " * size
    (err,) = nvrtc.nvrtcGetCUBIN(program, image)
    nvrtc.nvrtcDestroyProgram(program)
    return image


def main() -> None:
    image = cubin("sm_90")
    handle = nvfatbin.create([], 0)
    nvfatbin.add_cubin(handle, image, len(image), "90", "fill")
    out = bytearray(nvfatbin.size(handle))
    nvfatbin.get(handle, out)
    nvfatbin.destroy(handle)
    path = pathlib.Path(__file__).with_name("fill.fatbin")
    path.write_bytes(bytes(out))
    print(f"wrote {path} ({len(out)} bytes)")


if __name__ == "__main__":
    main()
