"""Data parallelism (SPEC 19) on a machine with two GPUs: the checks that
need real GPUs and NCCL, through the command line, on the tiny preset.

    python dev/cuda/dp_check.py [--out DIR]

1. agreement: `train --gpus 2` against one GPU at the same global batch,
   fp32 and bf16: each step's row losses, the held-out losses and the
   final P, M, V within SPEC 14's trajectory tolerance;
2. exact resume on 2 GPUs: 10 + 10 steps in two invocations against 20 in
   one, bitwise (checkpoint bytes and row losses);
3. the step-10 checkpoint of 2 GPUs resumed on one GPU for 10 steps,
   within tolerance of the one-GPU run;
4. torchrun: the same command under `torchrun --standalone
   --nproc_per_node 2` gives the bits of `--gpus 2`;
5. a rank killed (SIGKILL) while training: every process ends within 60 s,
   one error line, the last published checkpoint valid;
6. sharded optimizer state (SPEC 23): `train --gpus 2 --shard-optimizer`
   gives the checkpoint bytes and row losses of `--gpus 2` (no clipping:
   the same update element by element), and 10 sharded steps then 10
   unsharded give them too.

Every command's output goes to DIR/dp.log; a table of results is printed
last. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT)

from coppelius.conformance.tolerances import relative_error, tolerance  # noqa: E402
from coppelius.reference import results  # noqa: E402
from coppelius.reference.binding import load_state  # noqa: E402
from coppelius.reference.config import PRESETS  # noqa: E402
from coppelius.reference.stream import write_stream  # noqa: E402

CFG = PRESETS["tiny"]
B = 8
ROWS = []  # (check, result, detail)
LOG = None


def log(text):
    LOG.write(text + "\n")
    LOG.flush()


def record(check, ok, detail):
    ROWS.append((check, "PASS" if ok else "FAIL", detail))
    log(f"== {check}: {'PASS' if ok else 'FAIL'} {detail}")


def make_stream(path):
    rng = np.random.default_rng(11)
    n = 600 * CFG.context + 1
    ids = (np.arange(n) * 7 % CFG.vocab).astype(np.uint32)
    noise = rng.random(n) < 0.3
    ids[noise] = rng.integers(0, CFG.vocab, noise.sum())
    write_stream(path, ids, source_mtime_ns=0, source_size=0)


def train(run_dir, *extra, gpus=None, precision="bf16", launcher=(), timeout=240):
    argv = ["train", "--preset", "tiny", "--backend", "cupy", "--precision", precision,
            "--stream", STREAM, "--run-dir", run_dir, "--checkpoint", f"{run_dir}/ck.bin",
            "--batch", str(B), "--no-sample", "--eval-contexts", "16", "--eval-every", "10",
            *extra]
    if gpus:
        argv += ["--gpus", str(gpus)]
    command = [*launcher, sys.executable, "-m", "coppelius", *argv] if not launcher else \
        [*launcher, "-m", "coppelius", *argv]
    t0 = time.monotonic()
    p = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    log(f"$ {' '.join(command)}\n-> {p.returncode} in {time.monotonic() - t0:.1f} s\n"
        f"{p.stdout[-3000:]}{p.stderr[-3000:]}")
    return p


def rows_of(*paths):
    out = []
    for path in paths:
        out += [x for _, x in results.read_results(path).steps]
    return np.stack(out)


def agreement(tmp, precision):
    one, two = f"{tmp}/one-{precision}", f"{tmp}/two-{precision}"
    p1 = train(one, "--steps", "20", "--interval", "10", precision=precision)
    p2 = train(two, "--steps", "20", "--interval", "10", gpus=2, precision=precision)
    if p1.returncode or p2.returncode:
        record(f"agreement {precision}", False, f"exit {p1.returncode}, {p2.returncode}")
        return
    tol = tolerance("trajectory", precision)
    rows = relative_error(rows_of(f"{two}/results-0.bin"), rows_of(f"{one}/results-0.bin"))[0]
    r1, r2 = results.read_results(f"{one}/results-0.bin"), results.read_results(
        f"{two}/results-0.bin")
    ev = max(relative_error(b[2], a[2])[0] for a, b in zip(r1.evals, r2.evals))
    a, b = load_state(f"{one}/ck.bin", CFG), load_state(f"{two}/ck.bin", CFG)
    state = max(relative_error(getattr(b.state, n), getattr(a.state, n))[0] for n in "PMV")
    mean1 = float(np.mean([x.mean() for x in rows_of(f"{one}/results-0.bin")[-5:]]))
    record(f"agreement {precision}", max(rows, ev, state) <= tol and a.step == b.step == 20,
           f"2 GPUs vs 1 at B={B}, 20 steps: rows {rows:.2e}, held-out {ev:.2e}, P/M/V "
           f"{state:.2e} (tolerance {tol:.0e}); last-5 mean loss {mean1:.4f}")


def resume(tmp):
    whole, split, onto = f"{tmp}/two-bf16", f"{tmp}/split", f"{tmp}/onto-one"
    p = train(split, "--steps", "10", "--interval", "5", gpus=2)
    shutil.copytree(split, onto)
    q = train(split, "--steps", "10", gpus=2)
    if p.returncode or q.returncode:
        record("resume 2 GPUs", False, f"exit {p.returncode}, {q.returncode}")
    else:
        same_ck = open(f"{split}/ck.bin", "rb").read() == open(f"{whole}/ck.bin", "rb").read()
        a = rows_of(f"{split}/results-0.bin", f"{split}/results-10.bin")
        b = rows_of(f"{whole}/results-0.bin")
        record("resume 2 GPUs", same_ck and a.tobytes() == b.tobytes(),
               f"10+10 steps vs 20: checkpoint bytes {'equal' if same_ck else 'DIFFER'}, row "
               f"losses {'bitwise equal' if a.tobytes() == b.tobytes() else 'DIFFER'}")
    r = train(onto, "--steps", "10")
    if r.returncode:
        record("2 GPUs -> 1 GPU", False, f"exit {r.returncode}")
        return
    a, b = load_state(f"{onto}/ck.bin", CFG), load_state(f"{tmp}/one-bf16/ck.bin", CFG)
    err = relative_error(a.state.P, b.state.P)[0]
    rows = relative_error(rows_of(f"{onto}/results-10.bin"),
                          rows_of(f"{tmp}/one-bf16/results-0.bin")[10:])[0]
    tol = tolerance("trajectory", "bf16")
    record("2 GPUs -> 1 GPU", a.step == 20 and max(err, rows) <= tol,
           f"step-10 checkpoint of 2 GPUs, 10 steps on 1: P {err:.2e}, rows {rows:.2e} vs "
           f"the 1-GPU run (tolerance {tol:.0e})")


def torchrun(tmp):
    run_dir = f"{tmp}/torchrun"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node", "2"]
    p = train(run_dir, "--steps", "5", launcher=launcher)
    if p.returncode:
        record("torchrun", False, f"exit {p.returncode}")
        return
    a = rows_of(f"{run_dir}/results-0.bin")
    b = rows_of(f"{tmp}/two-bf16/results-0.bin")[:5]
    record("torchrun", a.tobytes() == b.tobytes(),
           f"5 steps under torchrun --nproc_per_node 2: row losses "
           f"{'bitwise equal to' if a.tobytes() == b.tobytes() else 'DIFFER from'} --gpus 2's")


def kill_a_rank(tmp):
    import psutil

    run_dir = f"{tmp}/killed"
    argv = [sys.executable, "-m", "coppelius", "train", "--preset", "tiny", "--backend", "cupy",
            "--stream", STREAM, "--run-dir", run_dir, "--checkpoint", f"{run_dir}/ck.bin",
            "--batch", str(B), "--no-sample", "--eval-contexts", "16", "--steps", "100000",
            "--interval", "20", "--repeat-data", "--gpus", "2"]
    parent = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    step = None
    while time.monotonic() < deadline and parent.poll() is None:
        try:
            step = load_state(f"{run_dir}/ck.bin", CFG).step
            if step >= 40:
                break
        except Exception:
            pass
        time.sleep(0.2)
    children = psutil.Process(parent.pid).children()
    rank1 = [c for c in children if c.environ().get("RANK") == "1"]
    if not rank1 or step is None:
        parent.kill()
        record("kill a rank", False, f"no checkpoint or no rank 1 (step {step})")
        return
    t0 = time.monotonic()
    os.kill(rank1[0].pid, signal.SIGKILL)
    try:
        out, err = parent.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        parent.kill()
        out, err = parent.communicate()
    ended = time.monotonic() - t0
    alive = [c.pid for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    log(f"killed rank 1 (pid {rank1[0].pid}) -> parent {parent.returncode} after {ended:.1f} s\n"
        f"{out[-2000:]}{err[-2000:]}")
    try:
        ck = load_state(f"{run_dir}/ck.bin", CFG)
        valid = f"valid at step {ck.step}"
    except Exception as e:  # noqa: BLE001 -- reported
        ck, valid = None, f"INVALID ({e})"
    lines = [line for line in err.splitlines() if "error" in line]
    record("kill a rank", ended < 60 and not alive and ck is not None and len(lines) == 1,
           f"rank 1 SIGKILLed at checkpoint step >= {step}: all ended in {ended:.1f} s "
           f"(exit {parent.returncode}), {len(lines)} error line(s): "
           f"{lines[0] if lines else '-'}; checkpoint {valid}")


def sharded(tmp):
    whole, run_dir, mixed = f"{tmp}/two-bf16", f"{tmp}/sharded", f"{tmp}/sharded-then-not"
    p = train(run_dir, "--steps", "20", "--interval", "10", "--shard-optimizer", gpus=2)
    q = train(mixed, "--steps", "10", "--shard-optimizer", gpus=2)
    r = train(mixed, "--steps", "10", "--no-shard-optimizer", gpus=2) if not q.returncode else q
    if p.returncode or q.returncode or r.returncode:
        record("sharded", False, f"exit {p.returncode}, {q.returncode}, {r.returncode}")
        return
    want = open(f"{whole}/ck.bin", "rb").read()
    same = [open(f"{d}/ck.bin", "rb").read() == want for d in (run_dir, mixed)]
    a, b = rows_of(f"{run_dir}/results-0.bin"), rows_of(f"{whole}/results-0.bin")
    record("sharded", all(same) and a.tobytes() == b.tobytes(),
           f"--shard-optimizer vs --gpus 2, 20 steps: checkpoint bytes "
           f"{'equal' if same[0] else 'DIFFER'}, row losses "
           f"{'bitwise equal' if a.tobytes() == b.tobytes() else 'DIFFER'}; 10 sharded + 10 "
           f"unsharded: checkpoint bytes {'equal' if same[1] else 'DIFFER'}")


def main():
    global LOG, STREAM
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/dp_check"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    LOG = open(os.path.join(args.out, "dp.log"), "w")
    os.chdir(ROOT)
    tmp = tempfile.mkdtemp(prefix="dp-check-")
    STREAM = f"{tmp}/tiny.tokens"
    make_stream(STREAM)
    for name, check in (("agreement fp32", lambda: agreement(tmp, "fp32")),
                        ("agreement bf16", lambda: agreement(tmp, "bf16")),
                        ("resume", lambda: resume(tmp)), ("torchrun", lambda: torchrun(tmp)),
                        ("kill a rank", lambda: kill_a_rank(tmp)),
                        ("sharded", lambda: sharded(tmp))):
        t0 = time.monotonic()
        try:
            check()
        except Exception as e:  # noqa: BLE001 -- one check's failure is its row
            record(name, False, f"{type(e).__name__}: {e}")
        print(f"{name}: {time.monotonic() - t0:.1f} s", flush=True)
    print("\ncheck            result  detail")
    for check, result, detail in ROWS:
        print(f"{check:<16} {result:<7} {detail}")
    return 0 if all(r == "PASS" for _, r, _ in ROWS) else 1


if __name__ == "__main__":
    STREAM = None
    sys.exit(main())
