"""How the model calls its layers: model_forward and model_backward
(reference/model.py) make each layer call through a tape,

    h, cache = tape.op("layers.0.attn_norm", "layernorm", layernorm_forward,
                       x, weight, bias, eps, out="layers.0.attn_norm.out")

naming the operation, its kind and its outputs as the semantic graph does
(SPEC 13). The model's code is then the one description of the step: a
`Tape` runs each call (and keeps its named outputs when asked), and
`semantic.Trace` records the same calls, computing nothing, as the semantic
graph. Nothing else in the model goes past the tape: the additions are
operations too, the parameters arrive as named views and the gradient
leaves as one flat vector.
"""

from __future__ import annotations

import numpy as np

from .params import registry


def gradient_name(name: str) -> str:
    """The name of the gradient of tensor `name`: `d` before its last segment
    (`layers.3.attn.q` -> `layers.3.attn.dq`, `logits` -> `dlogits`)."""
    head, _, last = name.rpartition(".")
    return f"{head}.d{last}" if head else f"d{last}"


class Tape:
    """Runs each operation. `record`: a dict that receives each named output
    (the intermediates of reference/semantic.py's naming scheme), or None."""

    def __init__(self, record: dict | None = None):
        self.record = record

    def op(self, name: str, kind: str, fn, *args, out):
        """fn(*args), returned as fn returns it. `name` and `kind` are the
        operation's in the semantic graph; `out` (a name, or a tuple of names)
        names the first values fn returns, in order (one array is one value);
        what follows them (a forward's cache) is not a tensor of the graph."""
        result = fn(*args)
        if self.record is not None:
            names = (out,) if isinstance(out, str) else out
            values = (result,) if isinstance(result, np.ndarray) else result
            self.record.update(zip(names, values))
        return result

    def parameters(self, config, P) -> dict:
        """name -> view of P with the parameter's shape (aliases included)."""
        return registry(config).views(P)

    def flatten(self, config, grads: dict, like: np.ndarray) -> np.ndarray:
        """G: each parameter's gradient (`grads`, by name) at its offset of a
        fresh flat vector with `like`'s shape and dtype (the registry's layout)."""
        G = np.zeros_like(like)
        for spec in registry(config):
            G[spec.slice] = grads[spec.name].reshape(-1)
        return G
