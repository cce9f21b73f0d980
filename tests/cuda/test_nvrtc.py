"""Every kernel source compiles with the real NVRTC (no GPU needed), and the cubin cache works."""

from __future__ import annotations

import pytest
from onnx_runtime.errors import ProviderError

nvrtc = pytest.importorskip("onnx_runtime_ep_cuda.nvrtc", reason="the CUDA provider is not installed")
driver = pytest.importorskip("onnx_runtime_ep_cuda.driver", reason="the CUDA provider is not installed")
bindings = pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-python is not installed")

try:
    bindings.nvrtcVersion()
except Exception as exc:  # the bindings import without libnvrtc and fail at the first call
    pytest.skip(f"libnvrtc cannot be loaded ({exc}); install nvidia-cuda-nvrtc", allow_module_level=True)

KERNEL_FILES = sorted(path.name for path in nvrtc.KERNEL_DIR.glob("*.cu"))
ARCHS = (80, 90)


@pytest.fixture(autouse=True)
def real_nvrtc(monkeypatch, tmp_path):
    """Real NVRTC even when the simulator switch is on, with a private disk cache per test."""
    monkeypatch.delenv(driver.SIM_ENV, raising=False)
    monkeypatch.setenv(nvrtc.CACHE_ENV, str(tmp_path / "cache"))
    nvrtc.clear_memory_cache()
    yield
    nvrtc.clear_memory_cache()


def test_the_kernel_folder_is_not_empty():
    assert "fill.cu" in KERNEL_FILES


@pytest.mark.parametrize("arch", ARCHS, ids=lambda arch: f"sm_{arch}")
@pytest.mark.parametrize("file", KERNEL_FILES)
def test_every_kernel_file_compiles(file, arch):
    image = nvrtc.compile(nvrtc.kernel_source(file), file, (), arch)
    assert image.startswith(b"\x7fELF"), "NVRTC returns a cubin (an ELF image)"


def test_cubins_are_cached_on_disk_and_reused(monkeypatch, tmp_path):
    source = nvrtc.kernel_source("fill.cu")
    first = nvrtc.compile(source, "fill.cu", (), 80)
    cached = list((tmp_path / "cache").glob("*.cubin"))
    assert len(cached) == 1 and cached[0].read_bytes() == first

    def no_compiler(*args):
        raise AssertionError("NVRTC ran although the cubin was cached")

    monkeypatch.setattr(nvrtc, "_compile_uncached", no_compiler)
    nvrtc.clear_memory_cache()
    assert nvrtc.compile(source, "fill.cu", (), 80) == first  # from disk
    cached[0].unlink()
    assert nvrtc.compile(source, "fill.cu", (), 80) == first  # from memory


def test_the_cache_key_covers_options_and_architecture(tmp_path):
    source = nvrtc.kernel_source("fill.cu")
    nvrtc.compile(source, "fill.cu", (), 80)
    nvrtc.compile(source, "fill.cu", (), 90)
    nvrtc.compile(source, "fill.cu", ("-DUNUSED=1",), 80)
    assert len(list((tmp_path / "cache").glob("*.cubin"))) == 3


def test_kernels_see_the_half_types_without_including_headers():
    source = 'extern "C" __global__ void twice(__half* x, __nv_bfloat16* y) {\n' \
             "    x[0] = __float2half(__half2float(x[0]) * 2.0f);\n" \
             "    y[0] = __float2bfloat16(__bfloat162float(y[0]) * 2.0f);\n}\n"
    assert nvrtc.compile(source, "twice.cu", (), 80).startswith(b"\x7fELF")


def test_a_syntax_error_raises_with_the_compiler_log():
    source = 'extern "C" __global__ void broken(int* x) {\n    x[0] = ;\n}\n'
    with pytest.raises(ProviderError) as caught:
        nvrtc.compile(source, "broken.cu", (), 80)
    message = str(caught.value)
    assert "broken.cu" in message and "sm_80" in message
    assert "broken.cu(2): error" in message, "the log line names the file and line"


def test_errors_in_an_included_header_name_the_header(tmp_path):
    (tmp_path / "helpers.cuh").write_text("__device__ int helper() { return undefined_name; }\n")
    (tmp_path / "main.cu").write_text(
        '#include "helpers.cuh"\nextern "C" __global__ void k(int* x) { x[0] = helper(); }\n'
    )
    source = nvrtc.kernel_source(tmp_path / "main.cu")
    assert source.count("helper()") == 2 and '#line 2 "main.cu"' in source
    with pytest.raises(ProviderError, match=r"helpers\.cuh\(1\): error"):
        nvrtc.compile(source, "main.cu", (), 90)


def test_a_missing_kernel_file_and_a_bad_architecture_are_reported():
    with pytest.raises(ProviderError, match="does not exist"):
        nvrtc.kernel_source("no_such_kernel.cu")
    with pytest.raises(ProviderError, match="not a GPU architecture"):
        nvrtc.compile("", "empty.cu", (), "compute_80")
