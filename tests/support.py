"""Helpers several test modules share (the tests folder is on the path)."""

from __future__ import annotations

import threading

import numpy as np

from coppelius.reference.stream import write_stream


def on_threads(n, work, timeout=30):
    """work(r) for r in range(n), each on a thread of its own (ranks as
    threads) -> their results in rank order. Every thread must end within
    `timeout` seconds; the first failure is raised."""
    out, failures = [None] * n, []

    def run(r):
        try:
            out[r] = work(r)
        except BaseException as e:  # noqa: BLE001 -- reported below
            failures.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a rank did not end"
    if failures:
        raise failures[0]
    return out


def pattern_stream(path, config, contexts: int, noise: float) -> str:
    """A synthetic token stream (no tokenizer) of `contexts` contexts of
    `config`: a learnable pattern (id 5 t mod V at position t), a fraction
    `noise` of its ids drawn at random instead. -> the path, as a str."""
    rng = np.random.default_rng(7)
    ids = (np.arange(contexts * config.context + 1) * 5 % config.vocab).astype(np.uint32)
    noisy = rng.random(ids.size) < noise
    ids[noisy] = rng.integers(0, config.vocab, noisy.sum())
    write_stream(path, ids, source_mtime_ns=0, source_size=0)
    return str(path)
