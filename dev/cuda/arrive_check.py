"""Where ptxas put the ping-pong kernels' barrier arrivals: for each
ping-pong variant of kernels/gemm_sm90.cu (or those matching PATTERN), the
SASS positions of its SYNCS.ARRIVE instructions around the tile's last
wgmma wait (WARPGROUP.DEPBAR gsb0 0), against its epilogue's first and last
MUFU / F2FP. An arrival far after the wait (hundreds of instructions, past
the epilogue's arithmetic) holds the other warpgroup's products or the
producer's next slab until the epilogue is done: ptxas schedules an
arrival that nothing depends on as late as it may.

    python dev/cuda/arrive_check.py [PATTERN] [--define NAME ...]

Needs NVRTC (nvidia-cuda-nvrtc) and cuobjdump with nvdisasm
(nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm) on PATH or beside NVRTC's
package; no GPU.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from coppelius.accelerated.cuda import gemm  # noqa: E402


def cuobjdump() -> str | None:
    """cuobjdump's path: on PATH, else in an nvidia-cuda-cuobjdump package."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    for d in sys.path:
        for path in glob.glob(os.path.join(d, "nvidia", "*", "bin", "cuobjdump")):
            return path
    return None


def functions(sass: str) -> dict:
    """kernel name -> its SASS instructions, in order"""
    out, name = {}, None
    for line in sass.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            name = m.group(1)
            out[name] = []
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if m and name:
            out[name].append(m.group(1))
    return out


def placements(options: list, pattern: str = r"_p_|_p2_") -> dict:
    """kernel name -> (the SYNCS.ARRIVE positions from 40 before the first
    wgmma wait for none outstanding, relative to it; its epilogue's MUFU and
    F2FP positions after it), for the module's kernels matching pattern
    that have such a wait"""
    cubin, _ = gemm.compile_cubin(options=options)
    tool = cuobjdump()
    if tool is None:
        raise FileNotFoundError("cuobjdump (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    env = dict(os.environ, PATH=os.path.dirname(tool) + os.pathsep + os.environ.get("PATH", ""))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True,
                              env=env, check=True).stdout
    out = {}
    for name, ins in sorted(functions(sass).items()):
        waits = [i for i, s in enumerate(ins) if "WARPGROUP.DEPBAR.LE gsb0, 0x0" in s]
        if not re.search(pattern, name) or not waits:
            continue
        w = waits[0]
        out[name] = ([i - w for i, s in enumerate(ins) if "SYNCS.ARRIVE" in s and i > w - 40],
                     [i - w for i, s in enumerate(ins) if i > w and ("MUFU" in s or "F2FP" in s)])
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("pattern", nargs="?", default=r"_p_|_p2_")
    p.add_argument("--define", action="append", default=[], help="a -D for the compile")
    args = p.parse_args()
    try:
        found = placements(gemm.compile_options() + [f"-D{d}" for d in args.define],
                           args.pattern)
    except FileNotFoundError as e:
        sys.exit(str(e))
    print(f"{'kernel':<42} {'arrivals (from the wait)':<28} epilogue's MUFU/F2FP")
    for name, (arrivals, work) in found.items():
        span = f"+{work[0]} .. +{work[-1]}" if work else "-"
        print(f"{name:<42} {' '.join(f'{a:+d}' for a in arrivals[:4]):<28} {span}")


if __name__ == "__main__":
    main()
