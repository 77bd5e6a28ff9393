"""Linear without bias: y = x @ W.T with W of shape (out, in). Every product
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
