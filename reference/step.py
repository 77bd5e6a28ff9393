"""The training step: forward, per-row losses, backward, AdamW."""

from __future__ import annotations

import numpy as np

from .adamw import adamw_update, clip_scale, gradient_norm
from .config import Config, Hyper, check_precision
from .model import loss_backward, loss_forward, model_backward, model_forward
from .params import registry
from .state import State, StepResult


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


def loss_and_grads(config: Config, P: np.ndarray, tokens: np.ndarray, policy: str = "fp32"):
    """tokens (B,T+1) -> (row losses (B,T), G (N,)): the gradient of the mean
    loss. Works in P's dtype (float64 for the finite-difference tests)."""
    tokens = np.asarray(tokens)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits, cache = model_forward(config, P, inputs, policy)
    ce, ce_cache = loss_forward(logits, targets)
    dlogits = loss_backward(ce_cache, ce.size, P.dtype)
    return ce, model_backward(config, P, dlogits, cache, policy)


def step(config: Config, state: State, tokens: np.ndarray, policy: str = "fp32",
         hyper: Hyper = Hyper(), grads: bool = False) -> StepResult:
    """One training step on tokens (B,T+1): the update number state.t + 1.
    `grads` keeps G, the gradient of the mean loss before any clipping."""
    check_precision(policy)
    # Overflow and NaN are values here, not warnings: the run loop checks the
    # row losses and parameters itself and stops with one line (SPEC 9).
    with np.errstate(all="ignore"):
        ce, G = loss_and_grads(config, state.P, tokens, policy)
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
    with np.errstate(all="ignore"):
        logits, cache = model_forward(config, P, tokens[:, :-1], policy, record)
        ce, ce_cache = loss_forward(logits, tokens[:, 1:])
        record["row_losses"] = ce
        dlogits = loss_backward(ce_cache, ce.size, P.dtype)
        record["dlogits"] = dlogits
        model_backward(config, P, dlogits, cache, policy, record)
    return {name: np.ascontiguousarray(record[name], dtype=np.float32)
            for name, _ in activation_names(config)}
