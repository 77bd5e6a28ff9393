"""The memory a plan needs, checked before it starts.

A plan whose memory cannot exist on this machine (`train --batch
1000000000`, `conformance --steps 10^20`) is refused with both numbers, where
it would otherwise end in a MemoryError half-way, or in the kernel's
out-of-memory killer, after writing files. The estimates are lower bounds:
what is refused certainly does not fit; what passes may still not.
"""

from __future__ import annotations

import os

from .config import Config, parameter_count
from .errors import RunError

FLOAT = 4  # bytes of a float32
ID = 8  # bytes of an int64 token id, as a batch is handed to a backend


def physical_memory() -> int | None:
    """This machine's physical memory in bytes, or None where it is unknown."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def step_bytes(config: Config, batch: int, on_host: bool = True) -> int:
    """At least what one training step holds in host memory: P, M, V and the
    gradient (4 N float32), the batch of ids (B, T+1) and its row losses
    (B, T); and, where the step runs on the host (`on_host`: the reference,
    MLX), the activations the backward keeps per context: per layer the
    attention probabilities (H, T, T), about 8 (T, D) and 3 (T, F) arrays,
    and the logits and their softmax, 2 (T, V)."""
    B, T, D, H, F, V, L = (batch, config.context, config.d_model, config.n_head, config.d_ff,
                           config.vocab, config.n_layer)
    need = 4 * FLOAT * parameter_count(config) + B * (T + 1) * ID + B * T * FLOAT
    if on_host:
        need += B * FLOAT * (L * (H * T * T + 8 * T * D + 3 * T * F) + 2 * T * V)
    return need


def check_fits(need: int, what: str) -> None:
    """Refuse (RunError, naming `what` and both numbers) a plan that needs
    more memory than this machine has."""
    have = physical_memory()
    if have is not None and need > have:
        raise RunError(f"{what}: needs at least {_gib(need)} of memory, this machine has "
                       f"{_gib(have)}")


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB" if n < 2**70 else f"about 2^{n.bit_length() - 1} bytes"


def check_step_fits(config: Config, batch: int, on_host: bool, model: str) -> None:
    """Refuse a step of `batch` contexts of the `model` (its preset's name or
    file) that cannot fit this machine's memory (step_bytes): what `train`
    and `bench` check before they build anything."""
    check_fits(step_bytes(config, batch, on_host=on_host), f"--batch={batch} on the {model} model")
