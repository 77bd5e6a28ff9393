"""cuDNN's fused attention (SDPA forward and backward) for the CuPy
backend's bf16 step, through NVIDIA's `nvidia-cudnn-frontend` Python
package (`import cudnn`) and the cuDNN 9 library it loads.

What it computes (SPEC 3, 5 and 21, causal attention of one layer, every
head): q, k, v are read straight out of the (BT, qkv) bfloat16 projection
of the step's layout (reference/layout.py: H query heads, Hkv key/value
heads; head h of q at column h*E, of k and v at K + h*E and V + h*E: dims
(B, H, T, E) for q and (B, Hkv, T, E) for k and v, strides (W T, E, W, 1)
with W the row's width, no copies). With Hkv < H query head h attends with
key/value head h // (H / Hkv), cuDNN's grouped-query attention, and the
backward's dk, dv of a key/value head are the sums over its query heads.
y is written as a bfloat16 operand in the (BT, D) layout; per row the
softmax's log-sum-exp (B, H, T) float32 is kept for the backward. The
backward reads q, k, v, y, dy and the statistics and writes dv straight
into the (BT, qkv) gradient of the projections and dq, dk, as bfloat16,
into the (BT, qk) buffer that the rope backward reads. Products accumulate in float32 (compute and
intermediate type float32), the scale multiplies q k^T, the mask is causal
(top-left aligned, the diagonal kept), and the backward is cuDNN's
deterministic algorithm: replays give the same bits, as the rest of the
step does. How its rounding differs from the reference's is a Reading in
SPEC 6. (cuDNN 9.19 builds a backward with float32 dq, dk but its
execution fails, "nullptr == dq_ptr": they are bfloat16, the type every
user of cuDNN's attention asks for.)

One graph per (B, T, H, Hkv, E) and direction, built once per process and
device (validate, operation graph, heuristics A then fallback, support,
plans) and shared by every layer, program and stream; each execution
names its buffers by address. A plan is built only outside a stream
capture: the step runs once eagerly before the capture, which builds it.
Before a shape is served, its graphs run twice on pseudo-random operands
(a trial): both runs must execute, write every output element finite and
agree bit for bit.
The workspace is the caller's (the step's Activations: one buffer of the
memory plan per direction). One cuDNN handle per device; its stream is set to the
current CuPy stream before an execution (again only when it changed, so
never inside a capture, whose stream is the warm-up's).

Anything that keeps cuDNN from serving a shape -- the frontend not
importable, no device, cuDNN refusing the graph (head dim, layout,
determinism), a failed trial -- is one line, `unavailable()`'s reason, and
the backend then runs its own attention kernels and reports why. COPPELIUS_NO_CUDNN=1
disables this path (the project's own kernels everywhere)."""

from __future__ import annotations

import os

import numpy as np

from ...reference.layout import qkv_columns

try:
    import cupy
except ImportError:  # the backend is simply unavailable
    cupy = None

# From this batch on the bf16 step's attention is cuDNN's where cuDNN serves
# the shape: every batch. Measured on the H200 (cuDNN 9.19, coppelius preset,
# one layer's forward and backward with the rope backward, ms): cuDNN 0.067,
# 0.080, 0.128, 0.217, 0.699 at B = 1, 2, 4, 8, 32 against the fused
# kernels' 0.111, 0.149, 0.235, 0.394, 1.316 and the materialized scores'
# 0.102, 0.206, 0.393, 0.767, 2.978 (dev/cuda/attention/cudnn_check.py).
MIN_BATCH = 1
# The backward's deterministic algorithm (no floating-point atomics): replays
# bitwise equal and resume exact, as SPEC 9 and 14 ask. False only for
# measuring what it costs (dev/cuda/attention/cudnn_check.py).
DETERMINISTIC = True

_frontend = None  # the cudnn module once imported
_import_error = None  # why it could not be, once tried
_handles = {}  # device id -> (handle, the stream last set)
_graphs = {}  # (device, B, T, H, Hkv, E, direction, deterministic) -> Graph, or the str why not
_trials = {}  # (device, B, T, H, Hkv, E, train, deterministic) -> '', or the str why not


def disabled() -> bool:
    return os.environ.get("COPPELIUS_NO_CUDNN", "") not in ("", "0")


def frontend():
    """The `cudnn` module of nvidia-cudnn-frontend, or None (see
    import_error())."""
    global _frontend, _import_error
    if _frontend is None and _import_error is None:
        try:
            import cudnn

            cudnn.backend_version()  # loads libcudnn: an absent library fails here
            _frontend = cudnn
        except Exception as e:  # ImportError, OSError of the library, anything it raises
            _import_error = f"{type(e).__name__}: {e}"
    return _frontend


def import_error() -> str:
    frontend()
    return _import_error or ""


def versions() -> dict:
    """The frontend's and cuDNN's versions (empty when not importable)."""
    cudnn = frontend()
    if cudnn is None:
        return {}
    return {"frontend": getattr(cudnn, "__version__", "?"),
            "cudnn": str(cudnn.backend_version())}


def _one_line(e: Exception) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}"


def _handle(device: int):
    """This device's handle and the stream it was last given: [handle, stream]."""
    if device not in _handles:
        _handles[device] = [frontend().create_handle(), None]
    return _handles[device]


class Graph:
    """One built cuDNN graph of one direction ("forward" or "backward") for
    one (B, T, H, Hkv, E) and its execution on addresses."""

    def __init__(self, direction: str, B: int, T: int, H: int, E: int, scale: float,
                 Hkv: int):
        self.direction, self.B, self.T, self.H, self.Hkv, self.E = direction, B, T, H, Hkv, E
        self.scale = float(scale)
        self.device = cupy.cuda.Device().id
        self.handle = _handle(self.device)
        cudnn = frontend()
        t = cudnn.data_type
        D = H * E
        dims, kv_dims = [B, H, T, E], [B, Hkv, T, E]  # q, y, dq; k, v, dk, dv
        _, k, v = qkv_columns(H, Hkv, E)  # the step's fused layout (reference/layout.py)
        W, QK = v.stop, k.stop
        self.qkv_stride = [T * W, E, W, 1]  # q, k, v inside the (BT, qkv) projection
        self.y_stride = [T * D, E, D, 1]  # y, dy: (BT, D)
        self.dqk_stride = [T * QK, E, QK, 1]  # dq, dk: (BT, qk)
        stats_dims, stats_stride = [B, H, T, 1], [H * T, T, 1, 1]
        g = cudnn.pygraph(io_data_type=t.BFLOAT16, intermediate_data_type=t.FLOAT,
                          compute_data_type=t.FLOAT, handle=self.handle[0])
        self.graph = g
        q = g.tensor(name="q", dim=dims, stride=self.qkv_stride, data_type=t.BFLOAT16)
        k = g.tensor(name="k", dim=kv_dims, stride=self.qkv_stride, data_type=t.BFLOAT16)
        v = g.tensor(name="v", dim=kv_dims, stride=self.qkv_stride, data_type=t.BFLOAT16)
        causal = _causal_mask(cudnn)
        if direction == "forward":
            o, stats = _call(g.sdpa, dict(name="sdpa", q=q, k=k, v=v, attn_scale=self.scale),
                             [dict(generate_stats=True), dict(is_inference=False)], causal)
            o.set_output(True).set_dim(dims).set_stride(self.y_stride).set_data_type(t.BFLOAT16)
            stats.set_output(True).set_dim(stats_dims).set_stride(stats_stride) \
                .set_data_type(t.FLOAT)
            self.tensors = (q, k, v, o, stats)
        else:
            o = g.tensor(name="o", dim=dims, stride=self.y_stride, data_type=t.BFLOAT16)
            dO = g.tensor(name="dO", dim=dims, stride=self.y_stride, data_type=t.BFLOAT16)
            stats = g.tensor(name="stats", dim=stats_dims, stride=stats_stride,
                             data_type=t.FLOAT)
            dq, dk, dv = _call(g.sdpa_backward,
                               dict(name="sdpa_backward", q=q, k=k, v=v, o=o, dO=dO, stats=stats,
                                    attn_scale=self.scale,
                                    use_deterministic_algorithm=DETERMINISTIC),
                               [{}], causal)
            dv.set_output(True).set_dim(kv_dims).set_stride(self.qkv_stride) \
                .set_data_type(t.BFLOAT16)
            for d, d_dims in ((dq, dims), (dk, kv_dims)):
                d.set_output(True).set_dim(d_dims).set_stride(self.dqk_stride) \
                    .set_data_type(t.BFLOAT16)
            self.tensors = (q, k, v, o, dO, stats, dq, dk, dv)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        self.workspace = int(g.get_workspace_size())

    def launch(self) -> dict:
        """What the executable plan and the memory plan's dry run record."""
        return {"graph": f"sdpa_{self.direction}", "batch": self.B, "context": self.T,
                "heads": self.H, "kv_heads": self.Hkv, "head_dim": self.E,
                "workspace": self.workspace}

    def execute(self, pointers: tuple, workspace: int) -> None:
        """Run on the current CuPy stream; pointers in the order of
        self.tensors (device addresses)."""
        cudnn = frontend()
        stream = cupy.cuda.get_current_stream().ptr
        if self.handle[1] != stream:
            if stream_capturing():
                raise RuntimeError("cuDNN attention: the handle's stream would change inside a "
                                   "capture")
            cudnn.set_stream(self.handle[0], stream)
            self.handle[1] = stream
        pack = {tensor: int(p) for tensor, p in zip(self.tensors, pointers)}
        self.graph.execute(pack, int(workspace), handle=self.handle[0])


def _causal_mask(cudnn) -> list:
    """Keyword sets for a causal mask, the frontend's preferred first."""
    sets = []
    if hasattr(cudnn, "diagonal_alignment"):
        sets.append(dict(diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT,
                         diagonal_band_right_bound=0))
    sets.append(dict(use_causal_mask=True))
    return sets


def _call(method, common: dict, variants: list, masks: list):
    """method(**common, **variant, **mask) with the first keyword sets this
    frontend accepts (older and newer releases name some arguments
    differently); the last TypeError if none does."""
    error = None
    for variant in variants:
        for mask in masks:
            try:
                return method(**common, **variant, **mask)
            except TypeError as e:
                error = e
    raise error


def stream_capturing() -> bool:
    try:
        return bool(cupy.cuda.get_current_stream().is_capturing())
    except Exception:
        return False


def _shape(B: int, T: int, H: int, Hkv: int, E: int) -> str:
    """The shape as the reasons name it (Hkv only where it is not H)."""
    return f"B={B} T={T} H={H}" + (f" Hkv={Hkv}" if Hkv != H else "") + f" E={E}"


def graph(direction: str, B: int, T: int, H: int, E: int, scale: float,
          kv_heads: int | None = None):
    """The built Graph for this shape on the current device, or the reason
    (a str) why cuDNN does not serve it; built on first use, outside a
    capture. kv_heads: Hkv, the key/value heads (None: H, no grouping)."""
    Hkv = H if kv_heads is None else kv_heads
    if disabled():
        return "disabled by COPPELIUS_NO_CUDNN"
    if frontend() is None:
        return f"nvidia-cudnn-frontend not importable ({_import_error})"
    try:
        device = cupy.cuda.Device().id
    except Exception as e:
        return f"no CUDA device ({_one_line(e)})"
    key = (device, B, T, H, Hkv, E, direction, DETERMINISTIC)
    if key not in _graphs:
        shape = _shape(B, T, H, Hkv, E)
        if stream_capturing():
            raise RuntimeError(f"cuDNN attention: the {direction} graph of {shape} would be "
                               "built inside a capture")
        try:
            _graphs[key] = Graph(direction, B, T, H, E, scale, Hkv)
        except Exception as e:
            _graphs[key] = f"cuDNN refuses the {direction} of {shape} ({_one_line(e)})"
    return _graphs[key]


def unavailable(B: int, T: int, H: int, E: int, scale: float, train: bool,
                kv_heads: int | None = None) -> str:
    """'' when cuDNN serves attention of this shape (the forward, and with
    train the backward too; kv_heads as graph()'s), else the one-line
    reason why not."""
    Hkv = H if kv_heads is None else kv_heads
    graphs = [graph(d, B, T, H, E, scale, kv_heads=Hkv)
              for d in ("forward", "backward")[:1 + train]]
    for g in graphs:
        if isinstance(g, str):
            return g
    key = (graphs[0].device, B, T, H, Hkv, E, train, DETERMINISTIC)
    if key not in _trials:
        _trials[key] = _trial(graphs)
    return _trials[key]


def _trial(graphs: list) -> str:
    """Run the forward (and the backward) twice on pseudo-random operands
    in buffers of the step's layout whose outputs start as NaN: '' when
    both runs execute, write every output element finite and (with the
    deterministic backward) agree bit for bit, else why not."""
    g = graphs[0]
    B, T, H, Hkv, E = g.B, g.T, g.H, g.Hkv, g.E
    D, BT = H * E, g.B * g.T
    shape = _shape(B, T, H, Hkv, E)
    rng = np.random.default_rng(0)

    def operand(cols):  # bfloat16 bits of N(0, 1) values, truncated
        x = rng.standard_normal((BT, cols)).astype(np.float32)
        return cupy.asarray((x.view(np.uint32) >> 16).astype(np.uint16))

    q, k, v = qkv_columns(H, Hkv, E)
    qkv, dy = operand(v.stop), operand(D)
    outputs = {"y": cupy.empty((BT, D), dtype=np.uint16),
               "stats": cupy.empty((B, H, T), dtype=np.float32),
               "dqk": cupy.empty((BT, k.stop), dtype=np.uint16),
               "dqkv": cupy.empty((BT, v.stop), dtype=np.uint16)}
    y, stats, dqk, dqkv = outputs.values()
    workspace = cupy.zeros((max(x.workspace for x in graphs) + 1,), dtype=np.uint8)
    p = lambda a, offset=0: a.data.ptr + offset * a.itemsize  # noqa: E731
    pointers = [(p(qkv), p(qkv, k.start), p(qkv, v.start), p(y), p(stats)),
                (p(qkv), p(qkv, k.start), p(qkv, v.start), p(y), p(dy), p(stats), p(dqk),
                 p(dqk, k.start), p(dqkv, v.start))]
    runs = []
    stream = cupy.cuda.get_current_stream()
    try:
        for _ in range(2):
            with stream:  # (no loop variable: it would keep an output alive past the trial)
                for name in outputs:
                    outputs[name].fill(0xFFFF if outputs[name].dtype == np.uint16 else np.nan)
            for x, ptrs in zip(graphs, pointers):
                x.execute(ptrs, p(workspace))
            stream.synchronize()
            runs.append({name: cupy.asnumpy(a) for name, a in outputs.items()})
    except Exception as e:
        return f"cuDNN fails to execute the attention of {shape} ({_one_line(e)})"
    finally:
        # the trial's device buffers go back to the device, not to the
        # pool's cache, where they would count in the program's memory
        del qkv, dy, y, stats, dqk, dqkv, workspace
        outputs.clear()
        cupy.get_default_memory_pool().free_all_blocks()
    written = {"y": np.s_[:], "stats": np.s_[:]}
    if len(graphs) > 1:
        written.update(dqk=np.s_[:], dqkv=np.s_[:, v.start:])  # of dqkv only dv
    for name, part in written.items():
        for run in runs:
            x = run[name][part]
            values = (x.astype(np.uint32) << 16).view(np.float32) if x.dtype == np.uint16 else x
            if not np.isfinite(values).all():
                return (f"cuDNN's attention of {shape} leaves {name} elements unwritten or not "
                        "finite")
        if DETERMINISTIC and not np.array_equal(runs[0][name], runs[1][name]):
            return f"cuDNN's attention of {shape} is not bitwise reproducible ({name})"
    return ""


def workspace_bytes(direction: str, B: int, T: int, H: int, E: int, scale: float,
                    kv_heads: int | None = None) -> int:
    """The workspace one execution of the direction's graph needs (a served
    shape; kv_heads as graph()'s). The deterministic backward's grows with B (16 MiB per context
    of the coppelius preset with cuDNN 9.19), the forward's stays small: the
    step gives each its own buffer, so the backward's lives in the backward
    alone."""
    return graph(direction, B, T, H, E, scale, kv_heads=kv_heads).workspace
