"""The layernorm backward of this tree (or of variant files) against
another version of its source, on the same random inputs: every output (dx
over dres, its operand, the weight-gradient partials, h again) bitwise
equal, and each one's time per launch (dev/cuda/kernel_bench.py's harness).

    PYTHONPATH=. python dev/cuda/layernorm_backward_check.py OLD_LAYERNORM_CU [VARIANT_CU ...]

(e.g. `git show HEAD~1:accelerated/cuda/kernels/layernorm.cu > /tmp/old.cu`).
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cupy  # noqa: E402
import kernel_bench as kb  # noqa: E402

from coppelius.accelerated.cuda.compile import KERNEL_DIR, Kernels  # noqa: E402
from coppelius.accelerated.cuda.layernorm import layernorm_chunks  # noqa: E402

# (contexts of 1,024 rows, D)
SHAPES = ((1, 512), (8, 512), (2, 1024), (8, 1024), (4, 2048), (1, 100))


def main() -> int:
    files = [os.path.abspath(f) for f in sys.argv[1:]]
    if len(files) == 1:
        files.append(os.path.join(KERNEL_DIR, "layernorm.cu"))
    versions = [Kernels("bf16", replace={"layernorm.cu": f}) for f in files]
    stream = cupy.cuda.Stream(non_blocking=True)
    failed = 0
    for B, D in SHAPES:
        rows = B * 1024
        chunks = layernorm_chunks(rows)

        def make():
            return dict(dout=kb.randn((rows, D)), dres=kb.randn((rows, D)),
                        x=kb.randn((rows, D)), m=kb.randn((rows,), 0.1),
                        r=kb.randn((rows,), 0.1) ** 2 + 1, w=kb.randn((D,)), b=kb.randn((D,)),
                        op=kb.empty((rows, D), np.uint16), part=kb.empty((chunks, 2 * D)),
                        h=kb.empty((rows, D), np.uint16))

        def run(k, c):
            k.layernorm_backward(c["dout"], c["dres"], c["x"], c["m"], c["r"], c["w"], c["dres"],
                                 c["op"], c["part"], b=c["b"], h=c["h"])

        inputs, outputs = make(), []
        for k in versions:
            c = {name: value.copy() for name, value in inputs.items()}
            with stream:
                run(k, c)
            stream.synchronize()
            outputs.append([cupy.asnumpy(c[n]).view(np.uint8) for n in ("dres", "op", "part", "h")])
        same = [all(np.array_equal(a, b) for a, b in zip(outputs[0], o)) for o in outputs[1:]]
        failed += not all(same)
        copies = [make() for _ in range(max(2, int(kb.WORKING_SET // (rows * D * 16))))]
        us = [kb.time_launches(stream, lambda c, k=k: run(k, c), copies, 20, 5) * 1e3
              for k in versions]
        gbs = [rows * D * 20 / (t * 1e3) for t in us]  # dout, dres, x read; dx, op, h written
        print(f"B={B} D={D}: bitwise equal to the first {same}; us per launch (GB/s): "
              + ", ".join(f"{os.path.basename(f)} {t:6.2f} ({g:,.0f})"
                          for f, t, g in zip(files, us, gbs)), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
