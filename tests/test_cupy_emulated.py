"""The CuPy backend on the CPU, through dev/cuda/emulate.py: NumPy stand-ins
for CuPy, the kernels and cuBLAS (dev/cuda/emulated). Everything but the
CUDA source is checked on every machine -- the buffer plan, launch
arguments, the row-major to column-major mapping of every product, capture
and replay semantics -- by the GPU tests (tests/cuda, run on the stand-ins
in pytest's own process where no GPU is: tests/cuda/conftest.py) and here
by the conformance suite and the attention harness, each run as a command
in a process of its own; the CUDA source itself is checked on a GPU."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMULATE = os.path.join(ROOT, "dev", "cuda", "emulate.py")


def run(*args):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, EMULATE, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_conformance_passes_on_the_emulated_backend():
    p = run("test")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    summaries = [line for line in p.stdout.splitlines() if line.startswith("conformance cupy")]
    # per policy: B = 1, then B = 2 as two micro-batches (SPEC 19)
    assert len(summaries) == 4 and all(line.endswith("PASS") for line in summaries), p.stdout[-2000:]


def test_a_model_wider_than_a_warp_holds_passes_on_the_emulated_backend(tmp_path):
    """SPEC 23: d_model 1152 (past the warp kernels' 1024: the norms' block
    variant, the embedding gradient's slices), head dim 128, RMSNorm,
    grouped heads and the untied head, against the reference (fewer steps,
    B = 1: the reference's step at this width is the slow part).
    dev/cuda/families/wide*.toml are wider still, for the GPU."""
    model = tmp_path / "wide.toml"
    model.write_text('vocab = 128\ncontext = 24\nd_model = 1152\nn_layer = 1\nn_head = 9\n'
                     'd_ff = 256\nnorm = "rmsnorm"\nn_kv_head = 3\ntied = false\n')
    p = run(str(model), "--steps", "2", "--one-context")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    summaries = [line for line in p.stdout.splitlines() if line.startswith("conformance cupy")]
    assert len(summaries) == 2 and all(line.endswith("PASS") for line in summaries), p.stdout[-2000:]


def test_attention_harness_runs_on_the_emulated_backend():
    """dev/cuda/attention/check.py end to end on the stand-ins: the
    package's fused attention checked (grouped heads too) and timed through
    cupy_debug. The stand-in kernels are NumPy: this checks the harness, not
    the kernels (those are checked on a GPU). The numbered variants index
    the ungrouped layout of their time: the harness runs them no more."""
    p = run("--script", os.path.join("dev", "cuda", "attention", "check.py"), "--preset", "test",
            "--batch", "1")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "variant in package: correct" in p.stdout, p.stdout[-2000:]
    assert "Hkv=1 T=130" in p.stdout, p.stdout[-2000:]  # a grouped shape was checked
