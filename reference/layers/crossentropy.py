"""Per-row cross-entropy (SPEC section 4): ce = logsumexp(logits) - logits[target]."""

import numpy as np


def crossentropy_forward(logits, targets):
    # logits (B,T,V), targets (B,T) -> ce (B,T)
    mx = logits.max(axis=-1, keepdims=True)
    e = np.exp(logits - mx)  # maximum subtracted
    se = e.sum(axis=-1, keepdims=True)
    lse = (np.log(se) + mx)[..., 0]  # (B,T)
    picked = np.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    probs = e / se  # (B,T,V) softmax, kept for the backward
    return lse - picked, (probs, targets)


def crossentropy_backward(dce, cache):
    # dce (B,T) -> dlogits (B,T,V) = dce * (softmax - onehot(target))
    probs, targets = cache
    dlogits = probs.copy()
    np.put_along_axis(dlogits, targets[..., None],
                      np.take_along_axis(dlogits, targets[..., None], axis=-1) - 1, axis=-1)
    return dlogits * dce[..., None]
