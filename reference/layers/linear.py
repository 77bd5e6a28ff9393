"""Linear: y = x @ W.T with W of shape (out, in), and y = x @ W.T + b where a
bias is declared (q, k, v under qkv_bias, SPEC 21). Every product
goes through precision.matmul, so under bf16 each operand is rounded."""

from ..precision import matmul


def linear_forward(x, W, policy):
    # x (...,in), W (out,in) -> y (...,out)
    return matmul(x, W.T, policy), (x, W)


def linear_backward(dy, cache, policy):
    # dy (...,out) -> dx (...,in), dW (out,in)
    x, W = cache
    n_in, n_out = x.shape[-1], dy.shape[-1]
    dx = matmul(dy, W, policy)
    dW = matmul(dy.reshape(-1, n_out).T, x.reshape(-1, n_in), policy)  # (out,N) @ (N,in)
    return dx, dW


def linear_bias_forward(x, W, b, policy):
    # x (...,in), W (out,in), b (out,) -> y = x @ W.T + b (...,out); the bias is added in
    # float32 after the product (SPEC 6: only the product's operands are rounded)
    y, cache = linear_forward(x, W, policy)
    return y + b, cache


def linear_bias_backward(dy, cache, policy):
    # dy (...,out) -> dx (...,in), dW (out,in), db (out,)
    dx, dW = linear_backward(dy, cache, policy)
    return dx, dW, dy.reshape(-1, dy.shape[-1]).sum(axis=0)
