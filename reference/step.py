"""The training step: forward, per-row losses, backward, AdamW."""

from __future__ import annotations

import numpy as np

from .adamw import adamw_update, clip_scale, gradient_norm
from .config import Config, Hyper, check_precision
from .errors import RunError
from .model import loss_backward, loss_forward, model_backward, model_forward
from .params import registry
from .state import State, StepResult
from .tape import Tape


def forward(config: Config, P: np.ndarray, tokens: np.ndarray, policy: str = "fp32") -> np.ndarray:
    """tokens (B,T) ids -> logits (B,T,V) with parameters P."""
    check_precision(policy)
    logits, _ = model_forward(config, P, np.asarray(tokens), policy)
    return logits


def row_losses(config: Config, P: np.ndarray, tokens: np.ndarray, policy: str = "fp32") -> np.ndarray:
    """tokens (B,T+1) -> row losses (B,T) with parameters P: the forward and
    the loss alone (held-out evaluation, SPEC 18); no backward, no update."""
    check_precision(policy)
    tokens = np.asarray(tokens)
    logits, _ = model_forward(config, P, tokens[:, :-1], policy)
    with np.errstate(all="ignore"):
        ce, _ = loss_forward(logits, tokens[:, 1:])
    return ce


def loss_and_grads(config: Config, P: np.ndarray, tokens: np.ndarray, policy: str = "fp32",
                   rows: int | None = None):
    """tokens (B,T+1) -> (row losses (B,T), G (N,)): the gradient of the sum
    of the row losses divided by `rows` (default B*T: the mean loss; a
    micro-batch of an accumulated step passes the whole batch's rows, SPEC
    19). Works in P's dtype (float64 for the finite-difference tests)."""
    tokens = np.asarray(tokens)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits, cache = model_forward(config, P, inputs, policy)
    ce, ce_cache = loss_forward(logits, targets)
    dlogits = loss_backward(ce_cache, ce.size if rows is None else rows, P.dtype)
    return ce, model_backward(config, P, dlogits, cache, policy)


def check_accumulate(batch: int, accumulate) -> int:
    """k >= 1 dividing B (SPEC 19), else a one-line RunError naming both."""
    k = accumulate
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise RunError(f"accumulate={k!r}: must be a positive integer")
    if batch % k:
        raise RunError(f"accumulate={k}: must divide the batch {batch} (micro-batches of B/k "
                       f"contexts)")
    return int(k)


def accumulated_loss_and_grads(config: Config, P: np.ndarray, tokens: np.ndarray,
                               policy: str = "fp32", accumulate: int = 1):
    """tokens (B,T+1) -> (row losses (B,T), G (N,)) as k micro-batches (SPEC
    19). Reading: micro-batch i holds rows [i*B/k, (i+1)*B/k) of the batch;
    each one's loss gradient is scaled by 1/(B*T); G = G_0 + G_1 + ... +
    G_{k-1}, added left to right in P's dtype (float32 in a step). k = 1 is
    loss_and_grads itself."""
    tokens = np.asarray(tokens)
    B = tokens.shape[0]
    k = check_accumulate(B, accumulate)
    if k == 1:
        return loss_and_grads(config, P, tokens, policy)
    b, rows = B // k, B * (tokens.shape[1] - 1)
    ces, G = [], None
    for i in range(k):
        ce, g = loss_and_grads(config, P, tokens[i * b:(i + 1) * b], policy, rows)
        ces.append(ce)
        G = g if G is None else G + g
    return np.concatenate(ces, axis=0), G


def step(config: Config, state: State, tokens: np.ndarray, policy: str = "fp32",
         hyper: Hyper = Hyper(), grads: bool = False, accumulate: int | None = None) -> StepResult:
    """One training step on tokens (B,T+1): the update number state.t + 1.
    `grads` keeps G, the gradient of the mean loss before any clipping.
    `accumulate` k (default: hyper.accumulate) computes G as k micro-batches
    (accumulated_loss_and_grads); the loss is the mean of all B*T rows."""
    check_precision(policy)
    k = hyper.accumulate if accumulate is None else accumulate
    # Overflow and NaN are values here, not warnings: the run loop checks the
    # row losses and parameters itself and stops with one line (SPEC 9).
    with np.errstate(all="ignore"):
        ce, G = accumulated_loss_and_grads(config, state.P, tokens, policy, k)
        loss = ce.mean(dtype=np.float32)
        norm = gradient_norm(G)  # before clipping: recorded whether or not it clips
        scale = clip_scale(hyper, norm)
        update = G if scale is None else G * scale
        t = state.t + 1
        P, M, V = adamw_update(state.P, state.M, state.V, update, registry(config).decay_mask(),
                               hyper, t)
    return StepResult(loss=np.float32(loss), row_losses=ce, grads=G if grads else None,
                      state=State(P, M, V, t), grad_norm=norm)


def step_activations(config: Config, P: np.ndarray, tokens: np.ndarray, policy: str = "fp32") -> dict:
    """tokens (B,T+1) -> {name: float32 array}: every intermediate of the
    forward and backward of one step with parameters P, under the names and
    in the order of reference.semantic.activation_names (no update). For
    debugging a backend layer by layer (`conformance --activations`)."""
    from .semantic import activation_names

    check_precision(policy)
    tokens = np.asarray(tokens)
    record = {}
    tape = Tape(record)  # keeps every named output of the step's operations
    with np.errstate(all="ignore"):
        logits, cache = model_forward(config, P, tokens[:, :-1], policy, tape=tape)
        ce, ce_cache = loss_forward(logits, tokens[:, 1:], tape)
        dlogits = loss_backward(ce_cache, ce.size, P.dtype, tape)
        model_backward(config, P, dlogits, cache, policy, tape=tape)
    return {name: np.ascontiguousarray(record[name], dtype=np.float32)
            for name, _ in activation_names(config)}
