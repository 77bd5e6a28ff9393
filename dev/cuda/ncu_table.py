"""Nsight Compute on a script's kernels, a line per profiled launch: on the
GPU machine (ncu at /usr/local/cuda/bin there; it fixes the clock at the
base 1.31 GHz, so its durations are longer than the step's):

    PYTHONPATH=$PWD python dev/cuda/ncu_table.py [--kernels REGEX] [--count N] \
        [-- python3 dev/cuda/epilogue_probe.py]

The command runs with PROBE_UNTIMED=1 (epilogue_probe.py then launches each
kernel three times and times nothing). Per launch: the duration, the most
used pipeline's share of the elapsed cycles (for the product kernels the
tensor pipe, which ncu may report as "Shared": wgmma's operand reads count
there), the issue slots busy, and the eligible warps a scheduler.
`--text FILE` reads a saved ncu report (its text output) instead."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys

SECTIONS = ("SpeedOfLight", "WarpStateStats", "SchedulerStats", "ComputeWorkloadAnalysis")
HEADER = re.compile(r"^  (\w+) \((\d+), \d+, \d+\)x\((\d+), \d+, \d+\)")
FIELDS = {"us": r"Duration\s+us\s+([\d.,]+)",
          "issue %": r"Issue Slots Busy\s+%\s+([\d.,]+)",
          "eligible": r"Eligible Warps Per Scheduler\s+warp\s+([\d.,]+)",
          "pipe %": r"is the highest-utilized pipeline \(([\d.]+)%\)"}


def launches(text: str) -> list:
    """ncu's text report -> [(kernel, {field: value})], in launch order."""
    out = []
    for line in text.splitlines():
        m = HEADER.match(line)
        if m:
            out.append((m.group(1), {}))
            continue
        if not out:
            continue
        for name, pattern in FIELDS.items():
            f = re.search(pattern, line)
            if f and name not in out[-1][1]:
                out[-1][1][name] = float(f.group(1).replace(",", ""))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kernels", default="gemm_", help="ncu --kernel-name regex")
    p.add_argument("--count", type=int, default=9, help="launches profiled")
    p.add_argument("--text", help="a saved ncu text report instead of a run")
    p.add_argument("command", nargs="*", default=["python3", "dev/cuda/epilogue_probe.py"])
    args = p.parse_args()
    if args.text:
        with open(args.text, encoding="utf-8", errors="replace") as f:
            text = f.read()
    else:
        ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
        cmd = [ncu, "--kernel-name", f"regex:{args.kernels}", "--launch-count", str(args.count)]
        for section in SECTIONS:
            cmd += ["--section", section]
        done = subprocess.run(cmd + args.command, capture_output=True, text=True,
                              env={**os.environ, "PROBE_UNTIMED": "1"})
        text = done.stdout + done.stderr
        if done.returncode:
            print(text[-3000:])
            sys.exit(done.returncode)
    rows = launches(text)
    print("| kernel | us | busiest pipe % | issue slots % | eligible warps |")
    print("| --- | --- | --- | --- | --- |")
    for kernel, v in rows:
        cells = [f"{v[k]:.2f}" if k in v else "-" for k in ("us", "pipe %", "issue %", "eligible")]
        print(f"| {kernel} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
