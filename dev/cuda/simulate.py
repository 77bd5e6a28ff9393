"""Run the backend's CUDA kernel source on the CPU: emulate.py's stand-ins
for CuPy and cuBLAS, but every kernel that simulate.h can run is the real
CUDA source (accelerated/cuda/kernels/*.cu as compile.module_source
assembles it), compiled as C++ by g++ and launched block by block, its
threads coroutines that meet at __syncthreads and at the warp calls. So
indexing, bounds, vector and scalar paths and barriers are checked without a
GPU. Kernels written in inline PTX (attention_fused.cu's tensor-core tiles)
keep emulate.py's NumPy versions. No timing, no memory model.

    python dev/cuda/simulate.py --pytest [pytest args]   # the GPU tests on simulated kernels
    python dev/cuda/simulate.py [preset]                 # the conformance suite, as emulate.py
    python dev/cuda/simulate.py --script path.py [args]  # a dev/cuda script

Needs g++ (C++17) on x86-64. Each module is compiled once and
cached by its source and options under $COPPELIUS_SIMULATE_CACHE (default:
the system's temporary folder). Float arithmetic is the host's with
-ffp-contract=off; expf and logf are glibc's, so a value through exp may
differ from the device's in the last place."""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import threading

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import emulate  # noqa: E402

# files whose kernels stay NumPy (inline PTX)
NOT_SIMULATED = ("attention_fused.cu",)
KERNEL = re.compile(r'extern "C" __global__ void\s+(\w+)\s*\(([^)]*)\)', re.S)
_LOCK = threading.Lock()
CACHE = os.environ.get("COPPELIUS_SIMULATE_CACHE",
                       os.path.join(tempfile.gettempdir(), "coppelius-simulate"))


def _strip_files(code: str) -> str:
    """The module source without the files of NOT_SIMULATED (each starts
    at its #line 1 directive)."""
    parts = re.split(r'(?m)^(?=#line 1 ")', code)
    return "".join(p for p in parts if not any(f'/{n}"' in p.split("\n", 1)[0]
                                                for n in NOT_SIMULATED))


def _strip_launch_bounds(code: str) -> str:
    """The source without its __launch_bounds__(...) (nested parentheses
    allowed): the simulation has no registers to bound."""
    out, i = [], 0
    while (j := code.find("__launch_bounds__(", i)) >= 0:
        out.append(code[i:j])
        depth, k = 0, j + len("__launch_bounds__")
        while True:
            depth += {"(": 1, ")": -1}.get(code[k], 0)
            k += 1
            if depth == 0:
                break
        i = k
    return "".join(out) + code[i:]


def _to_cpp(code: str) -> str:
    code = _strip_launch_bounds(code)
    code = re.sub(r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?(\w[\w ]*?)\s+(\w+)\[\];",
                  r"\1* \2 = (\1*)__sim_dynamic_shared;", code)
    return code.replace("__shared__", "static")


def _preprocess(code: str, defines: list) -> str:
    """The source with its macros expanded (the kernels some macros define
    become visible to _launchers); it includes no header."""
    p = subprocess.run(["g++", "-E", "-P", "-x", "c++", *defines, "-"], input=code,
                       capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"simulate: the preprocessor failed:\n{p.stderr[-4000:]}")
    return p.stdout


def _params(text: str) -> list:
    """Parameter types of a kernel's signature, in order."""
    types = []
    for p in (x.strip() for x in text.split(",") if x.strip()):
        p = p.replace("__restrict__", " ")
        m = re.match(r"(.*?)(\w+)\s*$", p, re.S)
        types.append(" ".join(m.group(1).split()))
    return types


def _launchers(code: str) -> tuple:
    names, out = [], []
    for name, params in KERNEL.findall(code):
        types = _params(params)
        unpack = ", ".join(f"*({t}*)a[{i}]" for i, t in enumerate(types))
        out.append(f'extern "C" int sim_{name}(unsigned gx, unsigned gy, unsigned gz, '
                   f'unsigned bx, unsigned by, unsigned bz, unsigned long long shared, void** a) '
                   f'{{ return __sim_launch(dim3{{gx, gy, gz}}, dim3{{bx, by, bz}}, shared, '
                   f'[=]() {{ {name}({unpack}); }}); }}')
        names.append((name, types))
    return names, "\n".join(out)


def compile_module(code: str, options=()) -> tuple:
    """(shared library, [(kernel, parameter types)]) of the CUDA source."""
    defines = [o for o in options if o.startswith("-D")]
    code = _to_cpp(_preprocess(_strip_files(code), defines))
    names, launchers = _launchers(code)
    text = f'#include "{os.path.join(HERE, "simulate.h")}"\n{code}\n{launchers}\n'
    with open(os.path.join(HERE, "simulate.h"), encoding="utf-8") as f:
        key = hashlib.sha256((text + f.read() + " ".join(defines)).encode()).hexdigest()[:20]
    os.makedirs(CACHE, exist_ok=True)
    lib = os.path.join(CACHE, f"module-{key}.so")
    if not os.path.exists(lib):
        src = os.path.join(CACHE, f"module-{key}.cpp")
        with open(src, "w", encoding="utf-8") as f:
            f.write(text)
        cmd = ["g++", "-std=c++17", "-O1", "-g", "-fPIC", "-shared", "-ffp-contract=off",
               "-fno-strict-aliasing", "-w", *defines, src, "-o", lib + ".tmp"]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode:
            sys.exit(f"simulate: g++ failed:\n{p.stderr[-4000:]}")
        os.replace(lib + ".tmp", lib)
    return ctypes.CDLL(lib), names


_C = {"int": ctypes.c_int32, "unsigned": ctypes.c_uint32, "unsigned int": ctypes.c_uint32,
      "long long": ctypes.c_int64, "unsigned long long": ctypes.c_uint64,
      "float": ctypes.c_float, "double": ctypes.c_double, "size_t": ctypes.c_uint64}


def _argument(ctype: str, value):
    if ctype.endswith("*"):
        if isinstance(value, np.uint64):  # the launchers' null pointer
            assert value == 0, value
            return ctypes.c_void_p(0)
        assert isinstance(value, np.ndarray), (ctype, type(value))
        return ctypes.c_void_p(value.__array_interface__["data"][0])
    assert ctype in _C, ctype
    want = {"int": np.int32, "long long": np.int64, "float": np.float32, "double": np.float64}
    if ctype in want:  # the launchers pass explicit numpy scalars: check the width
        assert isinstance(value, want[ctype]), (ctype, type(value), value)
    return _C[ctype](value.item() if hasattr(value, "item") else value)


class RawModule:
    """cupy.RawModule on the CPU: the simulated kernels, else emulate's NumPy ones."""

    def __init__(self, code, options=()):
        self.numpy = emulate.emulated.RawModule(code, options)
        self.lib, kernels = compile_module(code, options)
        self.kernels = dict(kernels)

    def get_function(self, name):
        if name not in self.kernels:
            return self.numpy.get_function(name)
        entry = getattr(self.lib, f"sim_{name}")
        types = self.kernels[name]

        def launch(grid, block, args, shared_mem=0):
            state = emulate.emulated.runtime._STATE
            capturing, current = state.capturing, state.current
            if capturing is not None and (not current or current[-1] is not capturing):
                raise AssertionError(f"kernel {name} launched outside the capturing stream")
            assert len(args) == len(types), (name, len(args), types)
            values = [_argument(t, a) for t, a in zip(types, args)]
            pointers = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
            g = tuple(int(x) for x in grid) + (1,) * (3 - len(grid))
            b = tuple(int(x) for x in block) + (1,) * (3 - len(block))

            def run(values=values, pointers=pointers):
                with _LOCK:  # one simulated launch at a time (ranks run as threads)
                    status = entry(*[ctypes.c_uint32(x) for x in g + b],
                                   ctypes.c_uint64(shared_mem), pointers)
                assert status == 0, f"simulated launch of {name} refused"

            emulate.emulated.runtime._submit(run)

        return launch


def main():
    emulate.emulated.fake_cupy.RawModule = RawModule
    emulate.main()


if __name__ == "__main__":
    main()
