"""cuDNN's stand-in (the frontend package `cudnn`): its attention
graphs (SDPA forward and backward) in NumPy."""

from __future__ import annotations

import ctypes
import types

import ml_dtypes
import numpy as np

from .common import _causal
from .runtime import _STATE, _submit


def _strided(addr, dims, strides, dtype):
    """The tensor at addr with dims and element strides, by real pointer
    arithmetic on host memory: a writable view."""
    itemsize = np.dtype(dtype).itemsize
    span = (sum((d - 1) * st for d, st in zip(dims, strides)) + 1) * itemsize
    raw = np.frombuffer((ctypes.c_char * span).from_address(addr), dtype=dtype)
    return np.lib.stride_tricks.as_strided(raw, shape=tuple(dims),
                                           strides=tuple(st * itemsize for st in strides),
                                           writeable=True)


class FakeCudnnTensor:
    def __init__(self, name, dim=None, stride=None, data_type=None):
        self.name, self.dim, self.stride, self.data_type = name, dim, stride, data_type
        self.output = False

    def set_output(self, value):
        self.output = value
        return self

    def set_dim(self, dim):
        self.dim = list(dim)
        return self

    def set_stride(self, stride):
        self.stride = list(stride)
        return self

    def set_data_type(self, data_type):
        self.data_type = data_type
        return self

    def read(self, addr):  # -> float32 values
        x = _strided(addr, self.dim, self.stride, np.float32 if self.data_type == "FLOAT"
                     else np.uint16)
        return x.astype(np.float32) if self.data_type == "FLOAT" else \
            (x.astype(np.uint32) << 16).view(np.float32)

    def write(self, addr, values):
        if self.data_type == "FLOAT":
            _strided(addr, self.dim, self.stride, np.float32)[...] = values
        else:
            _strided(addr, self.dim, self.stride, np.uint16)[...] = \
                np.asarray(values, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


class FakeCudnnGraph:
    """The classic pygraph calls cudnn_attention makes: one causal SDPA node
    (forward with its statistics, or backward), bfloat16 operands, float32
    arithmetic. The forward's operand of p v is round(p) of the normalized
    p, as the reference's; the backward's row term is dO . O, as cuDNN's;
    dq, dk, dv bfloat16, as the backend asks. Grouped-query attention as
    cuDNN's: k and v (and dk, dv) with Hkv heads where q has H, Hkv
    dividing H; query head h reads key/value head h // (H / Hkv), and the
    dk, dv of a key/value head are the float32 sums over its query heads,
    rounded once."""

    def __init__(self, io_data_type=None, intermediate_data_type=None, compute_data_type=None,
                 handle=None):
        assert (io_data_type, intermediate_data_type, compute_data_type) == \
            ("BFLOAT16", "FLOAT", "FLOAT")
        self.node = None

    def tensor(self, name, dim, stride, data_type):
        return FakeCudnnTensor(name, list(dim), list(stride), data_type)

    def _causal(self, kw):
        assert kw == {"diagonal_alignment": "TOP_LEFT", "diagonal_band_right_bound": 0}, kw

    def sdpa(self, name, q, k, v, attn_scale, generate_stats, **mask):
        assert generate_stats is True
        self._causal(mask)
        self.node = ("forward", attn_scale, (q, k, v), (FakeCudnnTensor("o"),
                                                       FakeCudnnTensor("stats")))
        return self.node[3]

    def sdpa_backward(self, name, q, k, v, o, dO, stats, attn_scale, use_deterministic_algorithm,
                      **mask):
        assert isinstance(use_deterministic_algorithm, bool)
        self._causal(mask)
        outs = tuple(FakeCudnnTensor(n) for n in ("dq", "dk", "dv"))
        self.node = ("backward", attn_scale, (q, k, v, o, dO, stats), outs)
        return outs

    def validate(self):
        assert all(t.output and t.dim and t.stride and t.data_type for t in self.node[3])
        # dims: q (B, H, T, E); k, v (B, Hkv, T, E), Hkv dividing H; each
        # output the dims of what it is of (o and dq: q's, dk: k's, dv: v's)
        q, k, v = self.node[2][:3]
        B, H, T, E = q.dim
        assert k.dim == v.dim and k.dim[0] == B and k.dim[2:] == [T, E] and H % k.dim[1] == 0, \
            (q.dim, k.dim, v.dim)
        if self.node[0] == "forward":
            o, stats = self.node[3]
            assert o.dim == q.dim and stats.dim == [B, H, T, 1], (o.dim, stats.dim)
        else:
            o, dO, stats = self.node[2][3:]
            assert o.dim == dO.dim == q.dim and stats.dim == [B, H, T, 1]
            assert [t.dim for t in self.node[3]] == [q.dim, k.dim, v.dim], self.node[3]

    def build_operation_graph(self):
        pass

    def create_execution_plans(self, modes):
        assert modes

    def check_support(self):
        want = ["BFLOAT16", "FLOAT"] if self.node[0] == "forward" else ["BFLOAT16"] * 3
        assert [t.data_type for t in self.node[3]] == want, self.node[3]

    def build_plans(self):
        pass

    def get_workspace_size(self):
        return 4096

    def execute(self, pack, workspace, handle=None):
        capturing, current = _STATE.capturing, _STATE.current
        if capturing is not None and (not current or current[-1] is not capturing):
            raise AssertionError("cuDNN executed outside the capturing stream")
        assert workspace and all(isinstance(p, int) for p in pack.values())
        direction, scale, inputs, outputs = self.node
        frozen = [pack[t] for t in inputs + outputs]
        _submit(lambda: self._run(direction, np.float32(scale), inputs, outputs, frozen))

    @staticmethod
    def _run(direction, scale, inputs, outputs, addrs):
        # one batch element at a time: the (H, T, T) scores of one element in
        # memory at once, not the (B, H, T, T) of all (at the production
        # shape, B=32 T=1024, 1.6 GB an array); each element's values are
        # computed alone either way, so the bits are the same
        x = [t.read(a) for t, a in zip(inputs, addrs)]
        per_element = [FakeCudnnGraph._run_element(direction, scale, [xi[b] for xi in x])
                       for b in range(x[0].shape[0])]
        for t, a, values in zip(outputs, addrs[len(inputs):], zip(*per_element)):
            t.write(a, np.stack(values))

    @staticmethod
    def _run_element(direction, scale, x):
        """One batch element's (H, T, E) operands (k, v (Hkv, T, E)) -> its
        outputs."""
        q, k, v = x[:3]
        H, T = q.shape[0], q.shape[-2]
        Hkv = k.shape[0]
        k, v = np.repeat(k, H // Hkv, axis=0), np.repeat(v, H // Hkv, axis=0)
        s = np.matmul(q, np.swapaxes(k, -1, -2)) * scale
        s[..., _causal(T)] = -np.inf
        if direction == "forward":
            m = s.max(-1, keepdims=True)
            e = np.exp(s - m)
            l = e.sum(-1, keepdims=True)
            p = round_bf16(e / l)
            return np.matmul(p, v), m + np.log(l)
        o, dO, stats = x[3:]
        p = np.exp(s - stats)
        dp = np.matmul(dO, np.swapaxes(v, -1, -2))
        ds = p * (dp - (dO * o).sum(-1, keepdims=True)) * scale
        dq, dk = np.matmul(round_bf16(ds), k), np.matmul(np.swapaxes(round_bf16(ds), -1, -2), q)
        dv = np.matmul(np.swapaxes(round_bf16(p), -1, -2), dO)
        # a key/value head's gradients: the sums over its query heads
        return dq, _group_sum(dk, Hkv), _group_sum(dv, Hkv)


def _group_sum(x, Hkv):
    # (H, T, E) per query head -> (Hkv, T, E)
    H, T, E = x.shape
    return x.reshape(Hkv, H // Hkv, T, E).sum(axis=1)


def round_bf16(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


fake_cudnn = types.ModuleType("cudnn")
fake_cudnn.__version__ = "emulated"
fake_cudnn.backend_version = lambda: 0
fake_cudnn.data_type = types.SimpleNamespace(BFLOAT16="BFLOAT16", FLOAT="FLOAT")
fake_cudnn.heur_mode = types.SimpleNamespace(A="A", FALLBACK="FALLBACK")
fake_cudnn.diagonal_alignment = types.SimpleNamespace(TOP_LEFT="TOP_LEFT")
fake_cudnn.pygraph = FakeCudnnGraph
fake_cudnn.create_handle = lambda: object()
fake_cudnn.set_stream = lambda handle, stream: None
