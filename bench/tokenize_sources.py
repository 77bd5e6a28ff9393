"""Bounded-memory tokenization against the library's own batch encoder.

Generates a JSONL corpus of about --megabytes MB (random words, one block of
records written again and again) and a byte-level BPE of --vocab ids
trained on a sample of it, then measures, each in a process of its own:

- `coppelius tokenize CORPUS --tokenizer BPE`: reads, encodes in bounded
  batches and publishes the stream;
- the `tokenizers` library's encode_batch over every document at once (all
  of them read into a list first), the ids kept as the stream would hold them.

Prints ids/s and the peak resident memory of each. The library's
whole-list encoding holds about 47 bytes per byte of source, so
--library-megabytes may give it a smaller corpus of the same records
(1 GB would need about 47 GB of memory).

    python bench/tokenize_sources.py --megabytes 1024 --library-megabytes 192
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

LIBRARY = """
import json, resource, sys, time
import numpy as np
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
started = time.perf_counter()
with open(sys.argv[2], "rb") as f:
    documents = [json.loads(line)["text"] for line in f]
encodings = tok.encode_batch_fast(documents, add_special_tokens=False)
n = sum(len(e.ids) for e in encodings)
ids = np.concatenate([np.array(e.ids, dtype=np.uint32) for e in encodings])
seconds = time.perf_counter() - started
print(json.dumps({"ids": n, "seconds": seconds,
                  "peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""

OURS = """
import json, resource, sys, time
from coppelius.cli import main
started = time.perf_counter()
status = main(["tokenize", sys.argv[2], "--tokenizer", sys.argv[1], "--vocab", sys.argv[3],
               "--out", sys.argv[4]])
seconds = time.perf_counter() - started
n = (__import__("os").path.getsize(sys.argv[4]) - 16) // 4
print(json.dumps({"ids": n, "seconds": seconds,
                  "peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
sys.exit(status)
"""


def corpus(path: str, megabytes: int, seed: int = 0) -> list:
    rng = random.Random(seed)
    vocabulary = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 9)))
                  for _ in range(5000)]
    sample = [" ".join(rng.choice(vocabulary) for _ in range(rng.randint(20, 400)))
              for _ in range(4000)]
    block = "".join(json.dumps({"text": t}) + "\n" for t in sample)
    with open(path, "w") as f:
        for _ in range(max(1, megabytes * 2**20 // len(block))):
            f.write(block)
    return sample


def measure(script: str, *argv) -> dict:
    out = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--library-megabytes", type=int, default=None,
                        help="the library's corpus, if smaller (default: --megabytes)")
    args = parser.parse_args()
    from coppelius.tokenizer import train_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "corpus.jsonl")
        started = time.perf_counter()
        sample = corpus(source, args.megabytes)
        size = os.path.getsize(source)
        bpe = os.path.join(tmp, "bpe", "tokenizer.json")
        os.makedirs(os.path.dirname(bpe))
        train_tokenizer(sample, args.vocab).save(bpe)
        print(f"corpus: {size / 2**20:,.0f} MiB of JSONL, BPE of {args.vocab} ids "
              f"({time.perf_counter() - started:.0f} s to make); {os.cpu_count()} cores")
        rows = [(f"coppelius tokenize, {size / 2**20:,.0f} MiB",
                 measure(OURS, bpe, source, str(args.vocab), os.path.join(tmp, "s", "c.tokens")))]
        theirs = source
        if args.library_megabytes and args.library_megabytes < args.megabytes:
            os.remove(source)
            theirs = os.path.join(tmp, "smaller.jsonl")
            corpus(theirs, args.library_megabytes)
        rows.append((f"encode_batch, whole, {os.path.getsize(theirs) / 2**20:,.0f} MiB",
                     measure(LIBRARY, bpe, theirs)))
    for name, r in rows:
        print(f"{name:36s} {r['ids']:>13,} ids {r['seconds']:8.1f} s "
              f"{r['ids'] / r['seconds']:>12,.0f} ids/s  peak {r['peak_kib'] / 1024:8,.0f} MiB")


if __name__ == "__main__":
    main()
