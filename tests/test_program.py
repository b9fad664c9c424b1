"""Programs: options, the on-disk compile cache, signatures from source, NVRTC errors."""

from __future__ import annotations

import contextlib
import os
import pathlib
import subprocess
import sys
import types
from typing import Any

import numpy as np
import pytest

import aiocuda
from aiocuda import _driver, program
from aiocuda._kernels import includes, nvjitlink, nvrtc
from aiocuda._kernels.compile_cache import CachedImage, CompileCache, cache_key, cached_compile, default_cache
from aiocuda._kernels.signature import cpp_linkage_kernels, parse_signature, ptx_signatures, source_signatures
from aiocuda.errors import ArgumentError, CompileError, LaunchError
from aiocuda.program import Program, ProgramOptions

from ._control import forked_while_held

KEY_ARGS: dict[str, Any] = {
    "source": "__global__ void k() {}",
    "options": ["--std=c++17", "-DX=1"],
    "name_expressions": ["k"],
    "arch": "sm_90",
    "compiler_version": "nvrtc 13.0",
}


# -- the cache -------------------------------------------------------------------------------------
def test_cache_key_is_sensitive_to_every_input() -> None:
    base = cache_key(**KEY_ARGS)
    assert cache_key(**{**KEY_ARGS, "name_expressions": list(reversed(KEY_ARGS["name_expressions"]))}) == base
    for field, other in [
        ("source", "__global__ void k2() {}"),
        ("options", ["--std=c++20", "-DX=1"]),
        ("options", list(reversed(KEY_ARGS["options"]))),  # order matters: -DX=1 -DX=2, include paths
        ("name_expressions", ["k<int>"]),
        ("arch", "sm_80"),
        ("compiler_version", "nvrtc 12.9"),
        ("name", "other.cu"),  # __FILE__, the log's file name, where quoted includes are found
    ]:
        assert cache_key(**{**KEY_ARGS, field: other}) != base, field


def _nvrtc_or_skip() -> None:
    try:
        nvrtc.load()
    except CompileError:
        pytest.skip("NVRTC is not installed (pip install nvidia-cuda-nvrtc)")


def _ptx_moves(entry: CachedImage) -> list[str]:
    return [line.split()[-1] for line in entry.image.decode().splitlines() if "mov.u32" in line]


def test_the_cache_tells_include_path_orders_and_program_names_apart(
    sim_backend: _driver.Driver, tmp_path: pathlib.Path
) -> None:
    """Options were sorted before hashing: with the include paths swapped the other
    folder's header wins, but the first order's image came back from the cache. The
    program's name was not hashed either: another name got the first one's log."""
    _nvrtc_or_skip()
    for folder, value in (("a", 1), ("b", 2)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "v.h").write_text(f"#define VALUE {value}\n")
    source = '#include <v.h>\nextern "C" __global__ void k(int* x) { int unused = 0; x[0] = VALUE; }'
    cache = tmp_path / "cache"

    def compile_with(paths: list[str], name: str = "program.cu") -> CachedImage:
        options = ProgramOptions(include_paths=paths, arch="compute_90")
        return Program(source, options=options, name=name, cache=cache)._compile_real(aiocuda.Device(0))

    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert _ptx_moves(compile_with([a, b])) == ["1;"]
    assert _ptx_moves(compile_with([b, a])) == ["2;"]
    assert "renamed.cu" in compile_with([a, b], name="renamed.cu").log


def test_cached_compile_hits_across_instances_and_survives_corruption(tmp_path: pathlib.Path) -> None:
    calls: list[int] = []

    def compiler() -> CachedImage:
        calls.append(1)
        return CachedImage(b"\x7fELF-image", "cubin", {"k<int>": "_Z1kIiEvv"}, "warning: x")

    args = ("src", ["-O3"], ["k<int>"], "sm_90", "nvrtc 13.0")
    first = cached_compile(CompileCache(tmp_path), *args, compiler)
    second = cached_compile(CompileCache(tmp_path), *args, compiler)  # a "new process": a new cache object
    assert calls == [1]
    assert second == first
    assert not [p for p in tmp_path.rglob(".tmp-*")], "temporary files must not be left behind"
    cached_compile(CompileCache(tmp_path), "other", ["-O3"], ["k<int>"], "sm_90", "nvrtc 13.0", compiler)
    assert calls == [1, 1]
    (entry,) = [p for p in tmp_path.rglob("*.bin") if cache_key("src", *args[1:]) in p.name]
    entry.write_bytes(b"garbage")
    assert cached_compile(CompileCache(tmp_path), *args, compiler) == first
    assert calls == [1, 1, 1]
    # damage of the right size: the image was loaded as it was, and a kind nothing loads
    good = entry.read_bytes()
    for damaged in (good[:-3] + bytes([good[-3] ^ 0x40]) + good[-2:], good.replace(b'"cubin"', b'"bogus"', 1)):
        entry.write_bytes(damaged)
        assert cached_compile(CompileCache(tmp_path), *args, compiler) == first
    assert calls == [1, 1, 1, 1, 1]
    assert cached_compile(None, *args, compiler) == first
    assert len(calls) == 6


def test_cache_write_failure_is_ignored(tmp_path: pathlib.Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    cache = CompileCache(blocker)
    cache.put("ab" * 32, CachedImage(b"x", "ptx", {}))
    assert cache.get("ab" * 32) is None


def test_default_cache_location(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.setenv("AIOCUDA_CACHE_DIR", str(tmp_path / "c"))
    cache = default_cache()
    assert cache is not None and cache.directory == tmp_path / "c"
    monkeypatch.setenv("AIOCUDA_CACHE_DIR", "off")
    assert default_cache() is None
    monkeypatch.delenv("AIOCUDA_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    cache = default_cache()
    assert cache is not None and cache.directory == tmp_path / "xdg" / "aiocuda"


def test_the_key_holds_the_headers_included_from_disk(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A header edited between two runs changes the compiled code: the key changes with
    the contents of every header found as NVRTC finds it (quoted: the includer's folder
    first, then the include paths; angled: the include paths), transitively."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "inc" / "sub").mkdir(parents=True)
    (tmp_path / "local.h").write_text('#include "inc/sub/inner.h"\n')
    (tmp_path / "inc" / "sub" / "inner.h").write_text('#include "leaf.h"\n#include "local.h"\n')  # a cycle
    (tmp_path / "inc" / "sub" / "leaf.h").write_text("#define LEAF 1\n")
    (tmp_path / "inc" / "lib.h").write_text("#define LIB 1\n")
    source = '#include "local.h"\n  #  include <lib.h> // a comment\n#include <cuda_fp16.h>\n'
    options = ["--include-path=inc"]

    def key() -> str:
        return includes.fingerprint(source, "program.cu", options)

    first = key()
    assert first and key() == first
    (tmp_path / "inc" / "sub" / "leaf.h").write_text("#define LEAF 2\n")  # two levels down, beside its includer
    second = key()
    assert second != first
    (tmp_path / "inc" / "lib.h").write_text("#define LIB 2\n")  # through the include path
    third = key()
    assert third != second
    (tmp_path / "inc" / "cuda_fp16.h").write_text("")  # a built-in header's name now found on disk
    assert key() != third
    assert includes.fingerprint("int x;", "program.cu", options) == ""
    assert includes.search_options(["-Ia", "-I", "b", "--include-path=c", "--pre-include=p.h", "-include", "q.h"]) == (
        ["a", "b", "c"],
        ["p.h", "q.h"],
    )


def test_an_edited_header_is_compiled_again(sim_backend: _driver.Driver, tmp_path: pathlib.Path) -> None:
    """The cache gave the image compiled with the header's old contents back."""
    _nvrtc_or_skip()
    (tmp_path / "params.h").write_text("#define VALUE 1\n")
    source = '#include "params.h"\nextern "C" __global__ void k(int* x) { x[0] = VALUE; }'

    def compile_now() -> CachedImage:
        program = Program(
            source, name=str(tmp_path / "k.cu"), options=ProgramOptions(arch="compute_90"), cache=tmp_path
        )
        return program._compile_real(aiocuda.Device(0))

    assert _ptx_moves(compile_now()) == ["1;"]
    (tmp_path / "params.h").write_text("#define VALUE 2\n")
    assert _ptx_moves(compile_now()) == ["2;"]


# -- options and signatures ------------------------------------------------------------------------
def test_program_options() -> None:
    opts = ProgramOptions(
        std="c++20",
        defines={"N": "4", "FLAG": None},
        include_paths=["/inc"],
        fast_math=True,
        line_info=True,
        max_registers=64,
        extra=["-G"],
    )
    assert opts.nvrtc_options() == [
        "--std=c++20",
        "-DN=4",
        "-DFLAG",
        "--include-path=/inc",
        "--use_fast_math",
        "--generate-line-info",
        "--maxrregcount=64",
        "-G",
    ]


ONE_KERNEL = 'extern "C" __global__ void k(float* x) { x[0] = 1; }'


def test_an_architecture_in_the_extra_options_is_the_one_compiled_for(
    sim_backend: _driver.Driver, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``-arch=compute_80`` in ``extra`` came after the device's own
    ``--gpu-architecture=sm_90``: NVRTC compiled for the last (making an sm_80 cubin
    too, which an sm_90 GPU cannot load), and that cubin was taken, where PTX was asked
    for, under the key of the device's architecture. The architecture the options name
    is now passed once and chooses the image's kind and the key, however it is spelled."""
    compiled: list[tuple[list[str], str]] = []

    def compile_program(source: str, name: str, options: list[str], names: list[str], arch: str) -> CachedImage:
        compiled.append((list(options), arch))
        return CachedImage(b"image", "cubin" if arch.startswith("sm_") else "ptx", {})

    def device_arch(compute_capability: tuple[int, int]) -> str:
        raise AssertionError("the device's architecture was chosen over the options' one")

    monkeypatch.setattr(nvrtc, "compile_program", compile_program)
    monkeypatch.setattr(nvrtc, "device_arch", device_arch)
    monkeypatch.setattr(nvrtc, "compiler_identity", lambda: "nvrtc 13.0")
    device = aiocuda.Device(0)
    for extra in (
        ["-arch=compute_80", "-G"],
        ["--gpu-architecture=compute_80", "-G"],
        ["-arch", "compute_80", "-G"],
        ["--gpu-architecture", "compute_80", "-G", "-arch=compute_80"],  # the same one twice
    ):
        compiled.clear()
        options = ProgramOptions(extra=extra)
        assert options.architecture() == "compute_80" and options.nvrtc_options() == ["--std=c++17", "-G"]
        entry = Program(ONE_KERNEL, options=options, cache=False)._compile_real(device)
        assert compiled == [(["--gpu-architecture=compute_80", "--std=c++17", "-G"], "compute_80")], extra
        assert entry.kind == "ptx"
    cache = tmp_path / "cache"
    Program(ONE_KERNEL, options=ProgramOptions(arch="compute_80"), cache=cache)._compile_real(device)
    compiled.clear()
    Program(ONE_KERNEL, options=ProgramOptions(extra=["-arch", "compute_80"]), cache=cache)._compile_real(device)
    assert compiled == []  # the same compile: the same key
    cubin = Program(ONE_KERNEL, options=ProgramOptions(extra=["-arch=sm_80"]), cache=cache)._compile_real(device)
    assert cubin.kind == "cubin"
    assert compiled == [(["--gpu-architecture=sm_80", "--std=c++17"], "sm_80")]


def test_nvrtc_compiles_ptx_for_a_compute_architecture_in_the_extra_options(
    sim_backend: _driver.Driver, tmp_path: pathlib.Path
) -> None:
    """The same, with NVRTC itself (no GPU needed): it was an sm_80 cubin."""
    _nvrtc_or_skip()
    options = ProgramOptions(extra=["-arch", "compute_80"])
    entry = Program(ONE_KERNEL, options=options, cache=tmp_path)._compile_real(aiocuda.Device(0))
    assert entry.kind == "ptx" and b".target sm_80" in entry.image
    assert "warning" not in entry.log  # (NVRTC warned of the architecture given twice)


def test_a_malformed_or_conflicting_architecture_is_refused() -> None:
    for options, message in (
        ({"extra": ["-arch=sm90"]}, r"'sm90' is not an architecture: sm_XY .* or compute_XY"),
        ({"extra": ["--gpu-architecture=native"]}, "'native' is not an architecture"),
        ({"extra": ["-G", "-arch"]}, "'-arch' ends the program's options without an architecture"),
        ({"arch": "compute90"}, "'compute90' is not an architecture"),
        ({"extra": ["-arch=sm_80", "-arch=sm_90"]}, "two architectures, 'sm_80' and 'sm_90'"),
        ({"arch": "sm_90", "extra": ["-arch=compute_90"]}, r"arch='sm_90'\) and 'compute_90' .* two architectures"),
    ):
        with pytest.raises(ArgumentError, match=message):
            ProgramOptions(**options)
    assert ProgramOptions(arch="sm_90a", extra=["-arch=sm_90a"]).architecture() == "sm_90a"
    assert ProgramOptions(extra=["--gpu-architecture=sm_100f"]).architecture() == "sm_100f"
    assert ProgramOptions().architecture() is None


def test_signatures_from_source() -> None:
    source = r"""
    /* extern "C" __global__ void commented_out(int x) {} */
    extern "C" __global__ void __launch_bounds__(256) k(const double* __restrict__ a, unsigned long long n) {}
    template <typename T, typename U> __global__ void t(T* out, U value) {}
    extern "C" __global__ void by_struct(struct Params p) {}
    """
    found = source_signatures(source, ["t<float, int>"])
    assert "commented_out" not in found
    k = found["k"]
    assert k is not None and [(p.dtype.name, p.pointer, p.name) for p in k] == [
        ("float64", True, "a"),
        ("uint64", False, "n"),
    ]
    t = found["t<float, int>"]
    assert t is not None and [(p.dtype.name, p.pointer) for p in t] == [("float32", True), ("int32", False)]
    assert found["by_struct"] is None
    assert "t" not in found


def test_signatures_that_would_mislead_are_read_as_c_does_or_not_at_all() -> None:
    source = r"""
    #ifdef USE_DOUBLE
    extern "C" __global__ void axpy(double a, const double* x, double* y, int n) {}
    #else
    extern "C" __global__ void axpy(float a, const float* x, float* y, int n) {}
    #endif
    typedef unsigned int uint;
    extern "C" __global__ void iota(uint* out, uint n) {}
    extern "C" __global__ void rows(float** table, int n) {}
    template <typename T, typename I = int> __global__ void gather(const T* src, const I* idx, T* dst, I n) {}
    """
    found = source_signatures(source, ["gather<float, long>"])
    assert found["axpy"] is None  # which one compiles depends on the defines: ask for a declaration
    iota = found["iota"]
    assert iota is not None and [p.dtype.name for p in iota] == ["uint32", "uint32"]  # C's uint, not numpy's
    rows = found["rows"]
    assert rows is not None and rows[0].pointer and rows[0].pointee is None  # a table of pointers: any array
    gather = found["gather<float, long>"]
    assert gather is not None and [p.dtype.name for p in gather] == ["float32", "int64", "float32", "int64"]


def test_cpp_linkage_kernels_are_told_apart() -> None:
    source = r"""
    __global__ void mangled(float* x) {}
    extern "C" __global__ void plain(float* x) {}
    extern "C" {
    __global__ void in_block(float* x) { if (x) { x[0] = 1; } }
    }
    extern "C" __global__ void declared_first(int n);
    __global__ void declared_first(int n) {}
    template <typename T> __global__ void templated(T* x) {}
    """
    assert cpp_linkage_kernels(source) == {"mangled"}


def test_a_kernel_without_c_linkage_is_refused_by_name_on_every_backend(backend: _driver.Driver) -> None:
    """Its symbol is mangled: on a GPU the driver did not find it, while the simulator ran
    it by its plain name (tests passed, the code failed on the hardware)."""
    source = 'extern "C" __global__ void plain(float* x) {}\n__global__ void scale(float* x, int n) {}'
    module = Program(source, cache=False).compile()
    with pytest.raises(ArgumentError, match=r'C\+\+ linkage.*extern "C".*name_expressions'):
        module.kernel("scale")
    module.kernel("plain")
    named = Program(source, name_expressions=["scale"], cache=False).compile()
    assert named.kernel("scale").signature is not None  # reached through its name expression


def test_a_kernel_the_module_lacks_is_named_with_those_it_has(backend: _driver.Driver) -> None:
    """On a GPU the driver said only "named symbol not found"."""
    source = 'extern "C" __global__ void scale(float* x) {}\ntemplate <class T> __global__ void fill(T* x) {}'
    module = Program(source, name="lookup.cu", name_expressions=["fill<float>"], cache=False).compile()
    with pytest.raises(ArgumentError, match=r"'lookup.cu' has no kernel 'scal': it defines \['fill<float>', 'scale'\]"):
        module.kernel("scal").function()
    with pytest.raises(ArgumentError, match=r"no kernel 'fill<int>'.*name_expressions=\['fill<int>'\]") as info:
        module.kernel("fill<int>").function()
    assert info.value.name == "CUDA_ERROR_NOT_FOUND"


def test_declared_signatures() -> None:
    assert parse_signature([np.float32, "ptr", "int64"]) == parse_signature("float, void*, long long")
    with pytest.raises(TypeError, match="not a supported"):
        parse_signature("struct Foo")
    with pytest.raises(TypeError):
        parse_signature([object])


def test_ptx_signatures() -> None:
    ptx = ".visible .entry k(\n .param .u64 k_param_0,\n .param .f32 k_param_1,\n .param .align 4 .b8 k_param_2[8]\n)"
    assert ptx_signatures(ptx) == {"k": None}
    sig = ptx_signatures(".entry j(.param .s32 a, .param .f64 b)")["j"]
    assert sig is not None and [p.dtype.name for p in sig] == ["int32", "float64"]
    llvm = ".entry s(.param .u64 .ptr .global .align 4 s_param_0, .param .f32 s_param_1)"  # (NVVM's pointers)
    sig = ptx_signatures(llvm)["s"]
    assert sig is not None and [(p.dtype.name, p.takes_address) for p in sig] == [("uint64", True), ("float32", False)]
    assert ptx_signatures(".entry u(.param .u64 .weird u_param_0)") == {"u": None}  # never a shorter signature


def test_ptx_integers_of_unknown_sign_take_negative_values() -> None:
    """NVRTC writes an ``int`` parameter as ``.u32``: -1 was refused as out of range."""
    from aiocuda._kernels.packing import ParamBuffer

    sig = ptx_signatures(".entry k(.param .u32 k_param_0, .param .s32 k_param_1, .param .u64 k_param_2)")["k"]
    assert sig is not None and [p.either_sign for p in sig] == [True, False, False]
    params = ParamBuffer(sig)
    params.pack((-1, -1, 5), None)
    assert params.values == (0xFFFFFFFF, -1, 5)
    with pytest.raises(LaunchError, match="argument 0"):
        params.pack((-(2**31) - 1, 0, 0), None)  # beyond 32 bits either way


# -- the simulated compiler ------------------------------------------------------------------------
def test_sim_compile_records_kernels(sim_backend: _driver.Driver) -> None:
    source = 'extern "C" __global__ void a(int* x) {}\ntemplate <class T> __global__ void b(T* x) {}'
    module = Program(source, name_expressions=["b<float>"]).compile()
    assert module.kind == "sim"
    assert module.kernel("a").function() is not None
    assert module.kernel("b<float>").function() is not None
    with pytest.raises(ArgumentError, match=r"no kernel 'c': it defines \['a', 'b<float>'\]"):
        module.kernel("c").function()
    with pytest.raises(ArgumentError, match=r"no kernel 'b<int>'.*name_expressions=\['b<int>'\]"):
        module.kernel("b<int>").function()
    with pytest.raises(CompileError, match=r"c<float>"):
        Program(source, name_expressions=["c<float>"]).compile()


def _nvrtc_installed() -> bool:
    try:
        nvrtc.load()
    except CompileError:
        return False
    return True


def test_the_simulator_compiles_with_nvrtc_and_reports_bad_source(
    sim_backend: _driver.Driver, tmp_path: pathlib.Path
) -> None:
    """NVRTC needs no GPU: on the simulator a program that does not compile fails as it
    would on a GPU, while a good one becomes a sim module whose kernels run in Python."""
    if not _nvrtc_installed():
        pytest.skip("NVRTC is not installed (pip install nvidia-cuda-nvrtc)")
    with pytest.raises(CompileError) as info:
        Program("void f( { }", name="bad.cu", cache=tmp_path).compile()
    assert "bad.cu" in str(info.value) and "error" in info.value.log
    good = Program('extern "C" __global__ void fine(int* x) { x[0] = 1; }', cache=tmp_path).compile()
    assert good.kind == "sim" and good.kernel("fine").function() is not None


def test_the_simulator_without_nvrtc_skips_the_compile(
    sim_backend: _driver.Driver, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def missing() -> Any:
        raise CompileError("no NVRTC here", name=nvrtc.NO_NVRTC)

    monkeypatch.setattr(nvrtc, "load", missing)
    monkeypatch.setattr(nvrtc, "_identity", None)
    monkeypatch.setattr(nvrtc, "_NVRTC_WHEEL_DIRS", ())
    module = Program('extern "C" __global__ void g(int* x) { x[0] = 1; }', cache=tmp_path).compile()
    assert module.kind == "sim" and module.kernel("g").function() is not None


# -- NVRTC -----------------------------------------------------------------------------------------
def test_missing_nvrtc_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    import cuda.bindings

    def missing() -> Any:
        raise RuntimeError('Failure finding "libnvrtc.so.13": No such file')

    fake = types.SimpleNamespace(nvrtcVersion=missing)
    monkeypatch.setattr(nvrtc, "_nvrtc_module", None)
    monkeypatch.setitem(sys.modules, "cuda.bindings.nvrtc", fake)
    monkeypatch.setattr(cuda.bindings, "nvrtc", fake, raising=False)
    with pytest.raises(CompileError, match="pip install nvidia-cuda-nvrtc") as info:
        nvrtc.load()
    assert info.value.name == "AIOCUDA_NO_NVRTC"


def test_compile_error_carries_the_log(cuda_backend: _driver.Driver, tmp_path: pathlib.Path) -> None:
    bad = 'extern "C" __global__ void broken(int* x) { x[0] = undeclared_name; }'
    with pytest.raises(CompileError) as info:
        Program(bad, cache=tmp_path).compile()
    assert "undeclared_name" in info.value.log
    assert "undeclared_name" in str(info.value)


def test_second_compile_comes_from_the_cache(
    cuda_backend: _driver.Driver, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = 'extern "C" __global__ void cached_kernel(int* x) { x[0] = 1; }'
    first = Program(source, cache=tmp_path).compile()
    assert first.kind == "cubin"

    def must_not_compile(*args: Any) -> Any:
        raise AssertionError("NVRTC was called although the cache holds the image")

    monkeypatch.setattr(nvrtc, "compile_program", must_not_compile)
    second = Program(source, cache=tmp_path).compile()
    assert second.image == first.image
    # and in a new process, through AIOCUDA_CACHE_DIR
    code = (
        "import aiocuda._kernels.nvrtc as n, aiocuda.program as p, sys\n"
        "n.compile_program = lambda *a: sys.exit('compiled again')\n"
        f"p.Program({source!r}).compile()\n"
    )
    env = {**os.environ, "AIOCUDA_CACHE_DIR": str(tmp_path), "AIOCUDA_BACKEND": "cuda"}
    env["PYTHONPATH"] = os.pathsep.join([str(pathlib.Path(program.__file__).parents[1]), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_a_source_nvrtc_would_cut_short_or_cannot_take_is_refused() -> None:
    """A NUL ended NVRTC's C string: the text after it was dropped without a word."""
    with pytest.raises(ArgumentError, match=r"k.cu: the source contains a NUL character \(at offset 3\)"):
        Program("int\0 garbage", name="k.cu")
    with pytest.raises(ArgumentError, match="not valid text at offset 3"):
        Program("// \udcff", name="k.cu")  # a lone surrogate (a file read with surrogateescape)
    with pytest.raises(TypeError, match="source must be str"):
        Program(b"int x;")  # type: ignore[arg-type]
    assert Program("// größe ✓").source == "// größe ✓"


def test_cache_argument_takes_a_switch_or_a_folder(tmp_path: pathlib.Path) -> None:
    assert Program("", cache=False)._cache is None
    assert Program("", cache=tmp_path)._cache is not None
    assert Program("", cache=str(tmp_path))._cache is not None
    with pytest.raises(TypeError, match="cache must be True, False or a folder path"):
        Program("", cache=42)  # type: ignore[arg-type]


def test_compiler_identity_from_the_wheel_without_loading_nvrtc(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    lib = tmp_path / "cu13" / "lib" / "libnvrtc.so.13"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"\x7fELF")
    spec = types.SimpleNamespace(submodule_search_locations=[str(tmp_path)])
    monkeypatch.setattr(nvrtc.importlib.util, "find_spec", lambda name: spec)
    monkeypatch.setattr(nvrtc, "_identity", None)
    monkeypatch.setattr(nvrtc, "load", lambda: pytest.fail("NVRTC must not be loaded"))
    identity = nvrtc.compiler_identity()
    assert identity.startswith(f"{lib}:4:")


INTERNED_BYTES_SCRIPT = """
from aiocuda._kernels import includes, nvrtc
image = nvrtc.compile_program('extern "C" __global__ void k(float* x) { x[0] = 1; }', "k.cu", [], [], "compute_75")
assert image.log == "" and image.image.startswith(b"//"), image
print("SPACE", repr(b" "), repr(b"a b".split(b" ")))
"""


def test_compiling_leaves_the_interpreters_shared_bytes_intact() -> None:
    """NVRTC writes its log into the buffer it is given. An empty log has size 1, and
    ``b" " * 1`` is CPython's process-wide ``b" "``: writing the NUL into it once broke
    every later ``b" "`` (and PyTorch's import). Needs NVRTC, not a GPU; run in a child
    process so that a regression cannot corrupt this one."""
    try:
        nvrtc.load()
    except CompileError:
        pytest.skip("NVRTC is not installed")
    proc = subprocess.run([sys.executable, "-c", INTERNED_BYTES_SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "SPACE b' ' [b'a', b'b']" in proc.stdout, proc.stdout


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.parametrize(
    ("loader", "lock", "loaded"), [(nvrtc, "_nvrtc_lock", "_nvrtc_module"), (nvjitlink, "_lock", "_module")]
)
def test_a_child_forked_while_another_thread_loads_a_compiler_loads_it(
    loader: types.ModuleType, lock: str, loaded: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fork while another thread was inside NVRTC's (or nvJitLink's) load() left its
    lock held in the child, where no thread would release it: the child's own load()
    waited forever. The child now loads it (or says it is not installed) at once."""
    monkeypatch.setattr(loader, loaded, None)  # (not loaded yet: load() takes the lock)

    def load() -> None:
        with contextlib.suppress(CompileError):
            loader.load()

    assert forked_while_held(getattr(loader, lock), load), (
        "the child's load() waited for a lock no thread would release"
    )
