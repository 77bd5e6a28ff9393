"""cuDNN's fused attention (SDPA forward and backward) for the CuPy
backend's bf16 step, through NVIDIA's `nvidia-cudnn-frontend` Python
package (`import cudnn`) and the cuDNN 9 library it loads.

What it computes (SPEC 3 and 5, causal attention of one layer, every head):
q, k, v are read straight out of the (BT, 3D) bfloat16 projection (head h
of q at column h*E, of k at D + h*E, of v at 2D + h*E: dims (B, H, T, E),
strides (3DT, E, 3D, 1), no copies); y is written as a bfloat16 operand in
the (BT, D) layout; per row the softmax's log-sum-exp (B, H, T) float32 is
kept for the backward. The backward reads q, k, v, y, dy and the
statistics and writes dv straight into the (BT, 3D) gradient of the
projections and dq, dk into the (BT, 2D) buffer that the rope backward
reads. Products accumulate in float32 (compute and intermediate type
float32), the scale multiplies q k^T, the mask is causal (top-left
aligned, the diagonal kept), and the backward is cuDNN's deterministic
algorithm: replays give the same bits, as the rest of the step does.
How its rounding differs from the reference's is a Reading in SPEC 6.

One graph per (B, T, H, E) and direction, built once per process and
device (validate, operation graph, heuristics A then fallback, support,
plans) and shared by every layer, program and stream; each execution
names its buffers by address. A plan is built only outside a stream
capture: the step runs once eagerly before the capture, which builds it.
The workspace is the caller's (the step's Activations: a buffer of the
memory plan). One cuDNN handle per device; its stream is set to the
current CuPy stream before an execution (again only when it changed, so
never inside a capture, whose stream is the warm-up's).

Anything that keeps cuDNN from serving a shape -- the frontend not
importable, no device, cuDNN refusing the graph (head dim, layout,
determinism) -- is one line, `unavailable()`'s reason, and the backend then
runs its own attention kernels and reports why. COPPELIUS_NO_CUDNN=1
disables this path (the project's own kernels everywhere)."""

from __future__ import annotations

import os

try:
    import cupy
except ImportError:  # the backend is simply unavailable
    cupy = None

# From this batch on the bf16 step's attention is cuDNN's where cuDNN serves
# the shape. Per layer, coppelius on an H200, forward + backward ms (cuDNN /
# the project's fused kernels / materialized scores; dev/cuda/NOTES.md):
# set from dev/cuda/attention/cudnn_check.py's table.
MIN_BATCH = 1
# The backward's deterministic algorithm (no floating-point atomics): replays
# bitwise equal and resume exact, as SPEC 9 and 14 ask. False only for
# measuring what it costs (dev/cuda/attention/cudnn_check.py).
DETERMINISTIC = True

BF16, FLOAT = "bfloat16", "float32"

_frontend = None  # the cudnn module once imported
_import_error = None  # why it could not be, once tried
_handles = {}  # device id -> (handle, the stream last set)
_graphs = {}  # (device, B, T, H, E, direction, deterministic) -> Graph, or the str why not


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
    one (B, T, H, E) and its execution on addresses."""

    def __init__(self, direction: str, B: int, T: int, H: int, E: int, scale: float,
                 dqk_type: str | None = None):
        self.direction, self.B, self.T, self.H, self.E = direction, B, T, H, E
        self.scale = float(scale)
        self.device = cupy.cuda.Device().id
        self.handle = _handle(self.device)
        cudnn = frontend()
        t = cudnn.data_type
        D = H * E
        dims = [B, H, T, E]
        self.qkv_stride = [T * 3 * D, E, 3 * D, 1]  # q, k, v inside the (BT, 3D) projection
        self.y_stride = [T * D, E, D, 1]  # y, dy: (BT, D)
        self.dqk_stride = [T * 2 * D, E, 2 * D, 1]  # dq, dk: (BT, 2D)
        stats_dims, stats_stride = [B, H, T, 1], [H * T, T, 1, 1]
        g = cudnn.pygraph(io_data_type=t.BFLOAT16, intermediate_data_type=t.FLOAT,
                          compute_data_type=t.FLOAT, handle=self.handle[0])
        self.graph = g
        q = g.tensor(name="q", dim=dims, stride=self.qkv_stride, data_type=t.BFLOAT16)
        k = g.tensor(name="k", dim=dims, stride=self.qkv_stride, data_type=t.BFLOAT16)
        v = g.tensor(name="v", dim=dims, stride=self.qkv_stride, data_type=t.BFLOAT16)
        causal = _causal_mask(cudnn)
        if direction == "forward":
            o, stats = _call(g.sdpa, dict(name="sdpa", q=q, k=k, v=v, attn_scale=self.scale),
                             [dict(generate_stats=True), dict(is_inference=False)], causal)
            o.set_output(True).set_dim(dims).set_stride(self.y_stride).set_data_type(t.BFLOAT16)
            stats.set_output(True).set_dim(stats_dims).set_stride(stats_stride) \
                .set_data_type(t.FLOAT)
            self.tensors = (q, k, v, o, stats)
            self.dqk_type = None
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
            dv.set_output(True).set_dim(dims).set_stride(self.qkv_stride).set_data_type(t.BFLOAT16)
            dqk = t.FLOAT if dqk_type == FLOAT else t.BFLOAT16
            dq.set_output(True).set_dim(dims).set_stride(self.dqk_stride).set_data_type(dqk)
            dk.set_output(True).set_dim(dims).set_stride(self.dqk_stride).set_data_type(dqk)
            self.tensors = (q, k, v, o, dO, stats, dq, dk, dv)
            self.dqk_type = dqk_type
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        self.workspace = int(g.get_workspace_size())

    def launch(self) -> dict:
        """What the executable plan and the memory plan's dry run record."""
        out = {"graph": f"sdpa_{self.direction}", "batch": self.B, "context": self.T,
               "heads": self.H, "head_dim": self.E, "workspace": self.workspace}
        if self.dqk_type is not None:
            out["dq_dk"] = self.dqk_type
        return out

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


def graph(direction: str, B: int, T: int, H: int, E: int, scale: float):
    """The built Graph for this shape on the current device, or the reason
    (a str) why cuDNN does not serve it; built on first use, outside a
    capture."""
    if disabled():
        return "disabled by COPPELIUS_NO_CUDNN"
    if frontend() is None:
        return f"nvidia-cudnn-frontend not importable ({_import_error})"
    try:
        device = cupy.cuda.Device().id
    except Exception as e:
        return f"no CUDA device ({_one_line(e)})"
    key = (device, B, T, H, E, direction, DETERMINISTIC)
    if key not in _graphs:
        if stream_capturing():
            raise RuntimeError(f"cuDNN attention: the {direction} graph of B={B} T={T} H={H} "
                               f"E={E} would be built inside a capture")
        # dq and dk as float32 (the rope backward's input type) where cuDNN
        # writes them so, else as bfloat16 operands
        for dqk in ((None,) if direction == "forward" else (FLOAT, BF16)):
            try:
                _graphs[key] = Graph(direction, B, T, H, E, scale, dqk)
                break
            except Exception as e:
                _graphs[key] = (f"cuDNN refuses the {direction} of B={B} T={T} H={H} E={E} "
                                f"({_one_line(e)})")
    return _graphs[key]


def unavailable(B: int, T: int, H: int, E: int, scale: float, train: bool) -> str:
    """'' when cuDNN serves attention of this shape (the forward, and with
    train the backward too), else the one-line reason why not."""
    for direction in ("forward", "backward") if train else ("forward",):
        g = graph(direction, B, T, H, E, scale)
        if isinstance(g, str):
            return g
    return ""


def workspace_bytes(B: int, T: int, H: int, E: int, scale: float, train: bool) -> int:
    """The workspace one execution of either direction needs (a served shape)."""
    return max(graph(d, B, T, H, E, scale).workspace
               for d in (("forward", "backward") if train else ("forward",)))


def dqk_type(B: int, T: int, H: int, E: int, scale: float) -> str:
    """The type the backward writes dq and dk in: float32 or bfloat16."""
    return graph("backward", B, T, H, E, scale).dqk_type
