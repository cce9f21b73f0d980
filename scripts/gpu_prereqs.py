"""Everything scripts/gpu_check.sh needs on a bare GPU machine, checked up front with a fix for each miss.

Prints one line per prerequisite (``ok``, ``MISSING``, ``TOO OLD``, ``optional``) and exits 1 when a required
one is not met, so the check stops before spending minutes on tests that could only fail. With
``--simulator`` (the dry run) the driver and the GPU come from the CUDA simulator and the GPU-only wheels are
reported but not required.

Required on a GPU: Python >= 3.10; numpy, onnx, ml_dtypes, pluggy, pytest; cuda-python 13 (cuda.bindings);
the NVRTC 13 wheel (nvidia-cuda-nvrtc, libnvrtc.so.13); the CUDA headers wheel (nvidia-cuda-runtime:
cuda_fp16.h, cuda_bf16.h); an NVIDIA driver for CUDA 13 (>= 580, cuDriverGetVersion >= 13000) with at least
one visible device of compute capability >= 7.0. Optional: torch with CUDA (the benchmark's torch columns),
transformers and the zoo's decoder exports (the generate rows), onnxruntime, pytest-timeout.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

CUDA_MAJOR = 13
MIN_DRIVER = 580  # the Linux driver branch of CUDA 13.0
MIN_DRIVER_API = CUDA_MAJOR * 1000  # cuDriverGetVersion of a driver that runs CUDA 13 code
MIN_ARCH = 70
HALF_HEADERS = ("cuda_fp16.h", "cuda_bf16.h")
PIP = "python -m pip install"


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = True

    def line(self) -> str:
        state = "ok" if self.ok else ("MISSING" if self.required else "optional")
        text = f"  [{state:>8}] {self.name:24} {self.detail}"
        return text + (f"\n             fix: {self.fix}" if not self.ok and self.fix else "")


def driver_branch(version: str) -> int | None:
    """The major branch of an nvidia-smi driver version ('580.65.06' -> 580), None when it is not one."""
    head = version.strip().split(".", 1)[0]
    return int(head) if head.isdigit() else None


def check_driver_version(smi_version: str | None) -> Check:
    """The driver nvidia-smi reports, against the branch CUDA 13 needs."""
    if smi_version is None:
        return Check("NVIDIA driver", False, "nvidia-smi not found or failed",
                     f"install the NVIDIA driver >= {MIN_DRIVER} (CUDA {CUDA_MAJOR}) and check the GPU is visible")
    branch = driver_branch(smi_version)
    if branch is None or branch < MIN_DRIVER:
        return Check("NVIDIA driver", False, f"{smi_version.strip()} is TOO OLD for CUDA {CUDA_MAJOR}",
                     f"upgrade the NVIDIA driver to >= {MIN_DRIVER}")
    return Check("NVIDIA driver", True, smi_version.strip())


def _module(name: str, dist: str, required: bool = True, why: str = "") -> Check:
    try:
        module = importlib.import_module(name)
    except Exception as exc:  # a broken install is as missing as an absent one
        return Check(name, False, f"{type(exc).__name__}: {exc}{why}", f"{PIP} '{dist}'", required)
    return Check(name, True, str(getattr(module, "__version__", "present")), required=required)


def _smi_version() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0] if out.returncode == 0 and lines else None


def _nvrtc(required: bool) -> Check:
    try:
        from cuda.bindings import nvrtc

        err, major, minor = nvrtc.nvrtcVersion()
        if int(err) != 0:
            raise RuntimeError(f"nvrtcVersion returned {err}")
    except Exception as exc:
        return Check("NVRTC", False, f"libnvrtc not loadable ({type(exc).__name__}: {exc})",
                     f"{PIP} 'nvidia-cuda-nvrtc=={CUDA_MAJOR}.*'", required)
    if major != CUDA_MAJOR:
        return Check("NVRTC", False, f"{major}.{minor}, not CUDA {CUDA_MAJOR}",
                     f"{PIP} 'nvidia-cuda-nvrtc=={CUDA_MAJOR}.*'", required)
    return Check("NVRTC", True, f"{major}.{minor}", required=required)


def _headers(required: bool) -> Check:
    found = None
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        found = find_nvidia_header_directory("cudart")
    except Exception:  # an old or missing pathfinder is the same problem as missing headers
        found = None
    if found is None and os.environ.get("CUDA_HOME"):
        found = os.path.join(os.environ["CUDA_HOME"], "include")
    if not found or not all(os.path.isfile(os.path.join(found, header)) for header in HALF_HEADERS):
        return Check("CUDA headers", False, f"{', '.join(HALF_HEADERS)} not found",
                     f"{PIP} 'nvidia-cuda-runtime=={CUDA_MAJOR}.*' (or set CUDA_HOME to a CUDA toolkit)", required)
    return Check("CUDA headers", True, found, required=required)


def _device(simulator: bool) -> list[Check]:
    """The driver API's view: version, devices, compute capability (through the provider's own loader)."""
    if simulator:
        os.environ["ONNX_RUNTIME_CUDA_SIM"] = "1"
    try:
        from onnx_runtime_ep_cuda import driver as access

        reason = access.probe()
        if reason:
            return [Check("CUDA driver API", False, reason, "see the reason; the provider reports the same")]
        d = access.load_driver_module()
        version = access.check(d, d.cuDriverGetVersion(), "cuDriverGetVersion")
        device = access.check(d, d.cuDeviceGet(0), "cuDeviceGet")
        name = access.check(d, d.cuDeviceGetName(256, device), "cuDeviceGetName").split(b"\0", 1)[0].decode()
        attribute = d.CUdevice_attribute
        major = access.check(d, d.cuDeviceGetAttribute(attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                                                        device), "cuDeviceGetAttribute")
        minor = access.check(d, d.cuDeviceGetAttribute(attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                                                        device), "cuDeviceGetAttribute")
        count = access.device_count()
    except Exception as exc:
        return [Check("CUDA driver API", False, f"{type(exc).__name__}: {exc}",
                      "install onnx-runtime-ep-cuda (pip install -e providers/cuda) and cuda-python")]
    label = " (simulated)" if simulator else ""
    api = Check("driver API version", int(version) >= MIN_DRIVER_API, f"{version}{label}",
                f"a driver for CUDA {CUDA_MAJOR} (cuDriverGetVersion >= {MIN_DRIVER_API}): upgrade to >= {MIN_DRIVER}")
    arch = major * 10 + minor
    gpu = Check("GPU", arch >= MIN_ARCH, f"{count} device(s); device 0: {name}, sm_{arch}{label}",
                f"a GPU of compute capability >= {MIN_ARCH // 10}.{MIN_ARCH % 10}")
    return [api, gpu]


def _zoo() -> Check:
    """The zoo's decoder exports the benchmark's generate rows run (optional: those rows say n/a without them)."""
    zoo = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", ".models", "zoo")
    names = ("gpt2.torchscript.fp32.onnx", "llama.dynamo.fp32.onnx")
    found = [name for name in names if os.path.isfile(os.path.join(zoo, name))]
    return Check("model zoo decoders", len(found) == len(names), f"{len(found)} of {len(names)} in {zoo}",
                 "run scripts/build_zoo.sh, or copy benchmarks/.models/zoo from a machine that built it "
                 "(the generate rows)", required=False)


def checks(simulator: bool) -> list[Check]:
    gpu_only = not simulator  # the wheels only the real driver path needs
    found = [Check("python", sys.version_info >= (3, 10), sys.version.split()[0], "use Python >= 3.10")]
    found += [_module(name, dist) for name, dist in
              (("numpy", "numpy>=1.24"), ("onnx", "onnx"), ("ml_dtypes", "ml_dtypes"), ("pluggy", "pluggy"),
               ("pytest", "pytest"))]
    found.append(_module("cuda.bindings", f"cuda-python>={CUDA_MAJOR},<{CUDA_MAJOR + 1}", gpu_only))
    found.append(_nvrtc(gpu_only))
    found.append(_headers(gpu_only))
    if simulator:
        found.append(Check("NVIDIA driver", True, "not needed: the dry run uses the CUDA simulator"))
    else:
        found.append(check_driver_version(_smi_version()))
    found += _device(simulator)
    found.append(_module("torch", "torch", False, " (a CUDA build gives the benchmark its torch columns; else n/a)"))
    found.append(_module("transformers", "transformers", False,
                         " (the generate rows rebuild the zoo's decoders in torch with it; else n/a)"))
    found.append(_zoo())
    found.append(_module("onnxruntime", "onnxruntime", False))
    found.append(_module("pytest_timeout", "pytest-timeout", False, " (no per-test time limit)"))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simulator", action="store_true", help="dry run: the CUDA simulator instead of a GPU")
    args = parser.parse_args()
    results = checks(args.simulator)
    print(f"prerequisites ({'dry run on the CUDA simulator' if args.simulator else 'GPU machine'}):")
    for check in results:
        print(check.line())
    missing = [check.name for check in results if check.required and not check.ok]
    if missing:
        print(f"NOT READY: {', '.join(missing)} (fixes above); nothing else was run")
        return 1
    print("ready")
    return 0


if __name__ == "__main__":
    sys.exit(main())
