"""Where the PyTorch peer's training step spends its device time, kernel by
kernel (torch.profiler), grouped as cuBLAS products, attention, AdamW and
the rest (Triton's fused kernels): the peer of `coppelius bench`, compiled
by torch.compile, its kernels launched one by one (not replayed as a graph:
the profiler then sees each of them; their times are a replay's).

    PYTHONPATH=. python dev/cuda/peer_profile.py [--preset llama-124m] [--batch 8]
        [--steps 5] [--gqa sdpa|repeat]

`--gqa` picks the peer's grouped-query idiom (bench/torch_peer.py
`gqa_idiom`) on a preset with n_kv_head < n_head: profile both to see which
the attention kernels and the copies favour on this PyTorch.

Set beside `dev/cuda/bench_step.py --breakdown` of the project's step.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from coppelius.bench.torch_peer import GQA_IDIOMS, TorchPeer  # noqa: E402
from coppelius.reference.config import preset  # noqa: E402
from coppelius.reference.params import initialize  # noqa: E402

GEMM = ("gemm", "nvjet", "xmma", "cutlass", "cublas", "splitkreduce")
ATTENTION = ("flash", "fmha", "sdpa", "attention")


def category(kernel: str) -> str:
    name = kernel.lower()
    if any(s in name for s in ATTENTION):
        return "attention"
    if any(s in name for s in GEMM):
        return "products"
    if "adam" in name or "multi_tensor_apply" in name:
        return "adamw"
    return "other (triton, copies)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="coppelius")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--gqa", choices=GQA_IDIOMS, default="auto",
                        help="grouped-query idiom where n_kv_head < n_head (default: auto)")
    args = parser.parse_args()
    config = preset(args.preset)
    tokens = np.random.default_rng(0).integers(0, config.vocab, (args.batch, config.context + 1))
    peer = TorchPeer(config, initialize(config), precision="bf16", device="cuda", gqa=args.gqa)
    loss = torch.compile(peer.mean_loss, dynamic=False)
    ids = peer.to_tokens(tokens)
    for _ in range(4):  # compiles, then lets the allocator and cuBLAS settle
        peer.step(ids, loss)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            peer.step(ids, loss)
        torch.cuda.synchronize()
    groups, kernels = collections.Counter(), collections.Counter()
    for event in prof.key_averages():
        if event.device_type.name != "CUDA":
            continue
        ms = event.device_time_total / args.steps / 1000
        groups[category(event.key)] += ms
        kernels[event.key[:90]] += ms
    grouped = f", gqa {peer.gqa}" if config.kv_heads < config.n_head else ""
    print(f"peer, {args.preset} preset, B={args.batch}, bf16{grouped}: device ms per step")
    for name, ms in groups.most_common():
        print(f"  {name:24s} {ms:7.3f}")
    print(f"  {'total':24s} {sum(groups.values()):7.3f}")
    print("largest kernels:")
    for name, ms in kernels.most_common(14):
        print(f"  {ms:7.3f}  {name}")


if __name__ == "__main__":
    main()
