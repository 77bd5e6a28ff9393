"""Compile the CUDA backend's kernel source (accelerated/cuda/kernels/*.cu,
assembled by compile.module_source) with NVRTC, as CuPy does, for both
precision policies, without a GPU: catches compile errors before any device
time is spent. Errors name the kernel file and its line.

    python dev/cuda/nvrtc_check.py [path/to/libnvrtc.so]

Without an argument, libnvrtc is looked up in NVIDIA's wheels
(pip install nvidia-cuda-nvrtc) and the usual library path."""

import ctypes
import glob
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from coppelius.accelerated.cuda import gemm  # noqa: E402
from coppelius.accelerated.cuda.compile import compile_options, module_source  # noqa: E402


def load(path=None):
    names = [path] if path else []
    for base in sys.path:
        names += glob.glob(os.path.join(base, "nvidia", "*", "lib", "libnvrtc.so*"))
    names += ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    sys.exit("libnvrtc not found")


def compile_source(lib, source, options):
    """(status, log): 0 and the log, or 1 and the errors."""
    try:
        return 0, gemm.nvrtc_compile(lib, source, options, cubin=False)[1]
    except gemm.GemmError as e:
        return 1, str(e)


def main():
    lib = load(sys.argv[1] if len(sys.argv) > 1 else None)
    failed = False
    for precision in ("fp32", "bf16"):
        options = ["-arch=compute_90", "-std=c++17", *compile_options(precision)]
        status, log = compile_source(lib, module_source(), options)
        print(f"{precision}: nvrtc status {status}")
        if log.strip():
            print(log)
        failed |= status != 0
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
