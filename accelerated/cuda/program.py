"""The CUDA backend's program (the module coppelius.accelerated.BACKENDS
names for `cupy`): available(), capture(), and CupyProgram, the captured
training step with the TrainingProgram interface (reference/program.py):
capture, replay, events, the pinned staging of submit(), evaluation,
state, logits and activations."""

from __future__ import annotations

import copy
import weakref

import numpy as np

try:
    import cupy
except ImportError:  # the backend is simply unavailable
    cupy = None

from ...reference.config import Config, Hyper, check_implemented
from ...reference.errors import RunError
from ...reference.params import registry
from ...reference.compilation import MemoryAnalysis
from ...reference.contract import (CapturedProgram, ReplayError, StepRecords, Submitted,
                                          capture_enabled, capture_or_fallback, check_capture,
                                          check_logits_tokens, check_replay_state, check_tokens,
                                          recompute_mode)
from ...reference.semantic import activation_names
from ...reference.state import State

from . import cublas, cudnn_attention, gemm, layernorm
from .buffers import Activations, Buffers, Gradient, _ptr, allocate_state
from .cublas import WORKSPACE_BYTES, Cublas
from .products import Products, own_products
from .distributed import Collectives
from .memory_plan import CommandLog, PlannedBuffers, planning_enabled
from .model import model_for
from .report import _memory_analysis, _partition_outcomes, _report
from .step import kernels_for, memory_plan, run_step, step_gradients

BACKEND = "cupy"
# The family's fields (SPEC 21) this backend computes (all of them; a field
# outside this tuple would be refused at capture by name)
IMPLEMENTED = ("norm", "norm_eps", "n_kv_head", "tied", "rope_base", "rotary", "qkv_bias")


def available() -> bool:
    """CuPy importable and at least one CUDA device present; never raises."""
    if cupy is None:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


class Event:
    """A submitted replay: wait() blocks until the step has finished."""

    def __init__(self, event):
        self.event = event  # cupy.cuda.Event recorded after the graph launch

    def wait(self) -> None:
        self.event.synchronize()


class TimedEvent(Event):
    """A replay between two device timestamps (replay_timed())."""

    def __init__(self, start, end):
        super().__init__(end)
        self.start = start

    def device_seconds(self) -> float:
        """Device time between the timestamps; waits for the step."""
        self.event.synchronize()
        return cupy.cuda.get_elapsed_time(self.start, self.event) / 1e3


def pinned_empty(shape, dtype) -> np.ndarray:
    """An uninitialized host array in page-locked memory."""
    n = int(np.prod(shape))
    memory = cupy.cuda.alloc_pinned_memory(max(n, 1) * np.dtype(dtype).itemsize)
    return np.frombuffer(memory, dtype, n).reshape(shape)


class StagingSlot:
    """Pinned host buffers for one submitted step: its tokens on the way in,
    its row losses, loss and norm on the way out. With W ranks the tokens
    are this rank's b = B/W contexts, the row losses all B, and a third
    scalar is the stop count (SPEC 19)."""

    def __init__(self, B: int, T: int, b: int | None = None):
        self.ids = pinned_empty((B if b is None else b, T + 1), np.int32)
        self.rows = pinned_empty((B * T,), np.float32)
        self.scalars = pinned_empty((3,), np.float32)  # the loss, the norm, the stop count
        self.copied = None  # the event recorded after the copies out
        self.submitted = None  # the step whose records the slot holds


class DeviceState:
    """The optimizer state the captured graph reads and writes."""

    backend = BACKEND

    def __init__(self, P, M, V, t):
        self.P, self.M, self.V, self.t = P, M, V, t  # (N,) float32 x3, (1,) int32


def _as_float32(x: np.ndarray) -> np.ndarray:
    """A buffer read back: bfloat16 bits (uint16) widened exactly, float32 as is."""
    return (x.astype(np.uint32) << 16).view(np.float32) if x.dtype == np.uint16 else x


class CupyProgram(CapturedProgram):
    """The captured training step on CUDA (the TrainingProgram interface)."""

    backend = BACKEND

    def __init__(self, config: Config, hyper: Hyper, precision: str, batch: int, state: State,
                 accumulate: int | None = None, comm=None, recompute=None,
                 shard: bool = False):
        k = hyper.accumulate if accumulate is None else accumulate
        self.recompute = recompute_mode(recompute)  # None, "gate-up" or "block"
        check_implemented(config, IMPLEMENTED, BACKEND)  # before anything is allocated
        if config.d_model > layernorm.MAX_D:  # SPEC 23: refused by field and limit
            raise RunError(f"d_model={config.d_model}: the CUDA backend's norm kernels hold "
                           f"a row in one block's registers, at most {layernorm.MAX_D} features")
        check_capture(config, precision, batch, state, k)
        # SPEC 19: W ranks of b = B/W contexts each, in k micro-batches of B/(W*k)
        W = 1 if comm is None else comm.world
        if batch % (W * k):
            raise RunError(f"batch={batch}: must divide by {W} ranks x accumulate {k} (each "
                           f"rank's B/W contexts in micro-batches of B/(W*k))")
        self.comm, self.world, self.rank = comm, W, 0 if comm is None else comm.rank
        self.shard = bool(shard) and W > 1  # one rank: nothing to shard (SPEC 23)
        self.local_batch = batch // W
        self.accumulate, self.micro_batch = k, batch // (W * k)
        self.config, self.hyper, self.precision, self.batch = config, hyper, precision, batch
        self.replays = 0
        T = config.context
        bf16 = precision == "bf16"
        op_dtype = np.uint16 if bf16 else np.float32

        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.alloc = alloc = Buffers(self.stream)
        self.buffers = s = allocate_state(alloc, config, hyper, precision, batch, k, W,
                                          self.shard, self.rank)
        # the names the rest of the program, its tests and dev/cuda/bench_step.py use
        self.P, self.M, self.V, self.Pb, self.t = s.P, s.M, s.V, s.Pb, s.t
        self.ids, self.norm, self.c, self.rates, self.partial, self.decay = \
            s.ids, s.norm, s.c, s.rates, s.partial, s.decay
        self.clip, self.adamw, self.betas = s.clip, s.adamw, s.betas

        # the process's compiled module, with a command log of this program's own
        self.kernels = copy.copy(kernels_for(precision))
        own = own_products(precision)
        self.blas = Products(Cublas(self.stream.ptr, _ptr(s.workspace), WORKSPACE_BYTES), own,
                             gemm.Kernels() if own else None)
        self.collectives = Collectives(comm, self.stream.ptr) if W > 1 else None
        weakref.finalize(self, self.blas.close)
        # the memory plan, made by a dry run of this very step before any
        # activation exists (accelerated/cuda/memory_plan.py)
        self.plan = memory_plan(config, hyper, precision, batch, k, W, self.recompute,
                                self.shard, self.rank)
        self.memory_planned = planning_enabled() and self.plan.savings > 0
        acts_alloc = PlannedBuffers(alloc, self.plan, self.stream) if self.memory_planned \
            else alloc
        self.acts = Activations(config, self.micro_batch, T, op_dtype, acts_alloc, train=True,
                                recompute=self.recompute)
        # the gradient: flat in s, or segments in the arena (after the activations, as planned)
        self.G, G_micro = step_gradients(config, s, acts_alloc)
        # whether G shares storage with the activations, so that an evaluation overwrites it
        self._gradient_shared = self.memory_planned and s.grad is None
        self._gradient_overwritten = False
        self.model = model_for(config, precision, self.kernels, self.blas, s, self.G)
        self.micro_model = (model_for(config, precision, self.kernels, self.blas, s, G_micro)
                            if k > 1 else None)
        self.device_state = self._owned = DeviceState(self.P, self.M, self.V, self.t)
        self._eager = None  # (B', T', Activations) of the last logits() shape
        self._windows = {}  # last_logits: padded length -> its Activations and token buffer
        self._uploaded = False
        self._stepped = False
        self._done = cupy.cuda.Event(disable_timing=True)  # recorded after each replay
        self._slots = None  # submit()'s pinned staging, on first use
        self.graph = None
        self.eval_ids = self.eval_ce = self.eval_rows = self.eval_graph = None  # evaluate()

        self._load(state)
        warm = CommandLog()
        self.recorded = self._counted(self._step, warm)  # compiles, lets cuBLAS choose
        if warm.signature() != [(c.kind, c.name, c.launch) for c in self.plan.commands]:
            # the plan's lifetimes are those of the dry run's commands
            raise AssertionError("the step's commands differ from the memory plan's dry run")
        self._load(state)  # the warm-up updated the state: capture performs no update
        self.captured = capture_enabled() and capture_or_fallback(self, self._record)
        self.stream.synchronize()

    # -- the step ----------------------------------------------------------------

    def _record(self) -> None:
        """Capture the step as a CUDA graph on the program's stream."""
        def record():
            self.stream.begin_capture()
            try:
                self._step()
            finally:
                graph = self.stream.end_capture()
            self.graph = graph  # only a capture that completed

        self.recorded = self._counted(record, CommandLog())

    def _load(self, state: State) -> None:
        """Host state -> the device buffers the graph reads (in place); with
        the state sharded, M and V of this rank's shard alone."""
        self.P.set(state.P, stream=self.stream)
        sh = self.buffers.shard
        own = slice(0, None) if sh is None else slice(sh.offset, sh.offset + sh.length)
        n = state.M[own].size
        self.M[:n].set(state.M[own], stream=self.stream)
        self.V[:n].set(state.V[own], stream=self.stream)
        self.t.set(np.array([state.t], dtype=np.int32), stream=self.stream)
        if self.Pb is not None:
            with self.stream:
                self.kernels.round_bf16(self.P, self.Pb)
        self.stream.synchronize()

    def _counted(self, work, log) -> dict:
        """Run work() on the stream with its commands logged; count them."""
        logged = [self.kernels, self.blas] + ([self.collectives] if self.collectives else [])
        for x in logged:
            x.log = log
        try:
            with self.stream:
                work()
        finally:
            for x in logged:
                x.log = None
        self.stream.synchronize()
        self._check_peers()
        kinds = [c.kind for c in log.commands]
        return {"kernel_launches": kinds.count("kernel"), "products": kinds.count("product"),
                "library_calls": kinds.count("library"),
                "collectives": kinds.count("collective"),
                "kernels": sorted({c.name for c in log.commands if c.kind == "kernel"})}

    def _step(self) -> None:
        run_step(self.model, self.kernels, self.acts, self.buffers, self.micro_model,
                 self.collectives)

    def _check_peers(self) -> None:
        """After a wait: the failure of another rank, reported while this
        one waited, is raised rather than the values of an aborted step
        handed on (accelerated/cuda/distributed.py)."""
        if self.comm is not None:
            self.comm.check()

    def _local(self, tokens) -> np.ndarray:
        """This rank's rows [r*b, (r+1)*b) of a (B, T+1) batch, int32."""
        b = self.local_batch
        return np.ascontiguousarray(tokens[self.rank * b:(self.rank + 1) * b], dtype=np.int32)

    def _evaluate(self) -> None:
        """Forward and row losses of the evaluation slot: the captured
        forward-only program (SPEC 18). It runs on the training step's own
        activations (free between steps, on the same stream; under the
        memory plan too: its commands are the step's forward and the
        classifier chunks' products and cross-entropy, in the step's order,
        so buffers sharing storage never live at once) and writes its losses
        to a buffer of its own, so the last step's row losses and loss stay
        readable. Its buffers share storage with the gradient's segments
        (the step's G, where it is not flat): gradients() refuses until the
        next step."""
        a, T = self.acts, self.config.context
        # the activations hold B/(W*k) contexts; the logits' gradient is scratch here
        b, dce = a.B, np.float32(1.0 / (a.B * T))
        for i in range(self.accumulate):
            ids = self.eval_ids[i * b:(i + 1) * b]
            self.model.forward(a, ids, T + 1)
            rows = self.eval_ce[i * b * T:(i + 1) * b * T]
            self.model.classifier_loss(a, ids, T + 1, rows, dce, backward=False)
        if self.world > 1:  # every rank's rows, in batch order
            self.collectives.all_gather(self.eval_ce, self.eval_rows)

    # -- the TrainingProgram interface -------------------------------------------------

    def upload_input(self, tokens) -> None:
        """tokens (B, T+1) ids -> the input slot. With W ranks, every rank is
        given the whole batch and takes its rows [r*b, (r+1)*b), b = B/W:
        rank r trains on contexts c0 + s*B + r*b + j (SPEC 19)."""
        tokens = check_tokens(self.config, self.batch, tokens)
        # a pending replay still reads the slot: the host waits for it before
        # the copy (free in training, where the previous step was waited for)
        self._done.synchronize()
        self.ids.set(self._local(tokens), stream=self.stream)
        self._uploaded = True

    def vote_stop(self) -> None:
        """W > 1: ask every rank to stop (a signal reached this one), from
        the next step submitted on. The step sums the ranks' counts in
        place (0 until a rank votes, and from then on nonzero), and every
        rank reads the same sum with the step's records (StepRecords.stops),
        so that all of them stop after the same step. Ordered on the stream
        after the step in flight: no wait."""
        self.buffers.stop.set(np.ones(1, np.float32), stream=self.stream)

    def stop_votes(self) -> int:
        """W > 1: the stop count of the last step (nonzero: some rank asked)."""
        self._last("stop_votes")
        return int(self.buffers.stop.get(stream=self.stream)[0])

    def replay(self) -> Event:
        """Submit one step without waiting; returns an event."""
        self._check_replay()
        self._submit()
        self._done.record(self.stream)
        self.replays += 1
        self._stepped = True
        return Event(self._done)

    def replay_timed(self) -> TimedEvent:
        """Submit one step between two device timestamps; returns at once."""
        self._check_replay()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()  # each replay's own pair
        start.record(self.stream)
        self._submit()
        self._done.record(self.stream)
        end.record(self.stream)
        self.replays += 1
        self._stepped = True
        return TimedEvent(start, end)

    def _check_replay(self) -> None:
        if not self._uploaded:
            raise ReplayError("replay before upload_input: the input slot is empty")
        check_replay_state(self.device_state, self._owned, BACKEND)

    def _submit(self) -> None:
        self._gradient_overwritten = False  # the step writes G again
        if self.graph is not None:
            self.graph.launch(stream=self.stream)
        else:
            with self.stream:
                self._step()

    def submit(self, tokens) -> Submitted:
        """Upload, replay and read back without the host waiting for the
        device: the tokens go through a pinned staging slot and an
        asynchronous copy ordered after the previous replay on the stream;
        after the replay, asynchronous copies of the row losses, the loss
        and the norm go to the same slot's pinned buffers, and records()
        waits for that slot's event alone. Two slots alternate, so step s is
        read while step s+1 runs; a slot is reused two submissions later,
        once the records it holds have been read (records() copies them)."""
        tokens = self._local(check_tokens(self.config, self.batch, tokens))  # this rank's rows
        check_replay_state(self.device_state, self._owned, BACKEND)
        slot = self._staging()[self.replays % 2]
        if slot.submitted is not None:  # two submissions ago: kept before the slot is reused
            slot.submitted.records()
        slot.ids[...] = tokens
        self.ids.set(slot.ids, stream=self.stream)
        self._uploaded = True
        timed = self.replay_timed()
        self._row_loss_buffer().get(stream=self.stream, out=slot.rows, blocking=False)
        self.acts.loss.get(stream=self.stream, out=slot.scalars[0:1], blocking=False)
        self.norm[0:1].get(stream=self.stream, out=slot.scalars[1:2], blocking=False)
        if self.world > 1:
            self.buffers.stop.get(stream=self.stream, out=slot.scalars[2:3], blocking=False)
        copied = slot.copied = cupy.cuda.Event(disable_timing=True)
        copied.record(self.stream)
        B, T = self.batch, self.config.context

        def read():
            copied.synchronize()
            self._check_peers()  # not the records of a step another rank's failure aborted
            return StepRecords(float(slot.scalars[0]), slot.rows.reshape(B, T).copy(),
                               float(slot.scalars[1]), timed.device_seconds(),
                               int(slot.scalars[2]) if self.world > 1 else 0)

        slot.submitted = Submitted(read)
        return slot.submitted

    def _staging(self) -> list:
        """The two pinned host slots of submit(), made on first use."""
        if self._slots is None:
            B, T = self.batch, self.config.context
            self._slots = [StagingSlot(B, T, self.local_batch) for _ in range(2)]
        return self._slots

    def _row_loss_buffer(self):
        """The device buffer of the last replay's (B*T) row losses: with W
        ranks, every rank's, gathered in batch order."""
        if self.world > 1:
            return self.buffers.gathered
        return self.acts.ce if self.accumulate == 1 else self.buffers.rows

    def _host_loss(self) -> float:
        """The last replay's mean loss, after its wait (the base's
        replay_and_wait and replay_timed_and_wait): not the loss of a step
        another rank's failure aborted."""
        self._check_peers()
        return float(self.acts.loss.get(stream=self.stream)[0])  # the step's one read back

    def loss(self):
        """The captured loss buffer, (1,) float32 on the device; no wait."""
        if not self._stepped:
            raise ReplayError("loss: no step has been replayed yet")
        return self.acts.loss

    def is_complete(self) -> bool:
        return bool(self._done.done)  # cudaEventQuery: no wait

    def wait(self) -> None:
        self._done.synchronize()

    def _release(self) -> None:
        """Drop every device buffer, the graphs and the cuBLAS handle: the
        memory returns to CuPy's pool. (The compiled kernel module stays:
        it is shared by every program of the process.)"""
        self.blas.close()
        self.graph = self.eval_graph = None
        self.collectives = self.comm = None  # the communicator is its owner's to end
        self.acts = self.buffers = self.model = self._eager = self._windows = None
        self.P = self.M = self.V = self.G = self.Pb = self.t = self.ids = self.norm = None
        self.c = self.rates = self.partial = self.decay = None
        self.device_state = self._owned = None
        self.eval_ids = self.eval_ce = self.eval_rows = None
        self._slots = None
        self.alloc.bytes = 0

    def _last(self, what):
        if not self._stepped:
            raise ReplayError(f"{what}: no step has been replayed yet")
        self._done.synchronize()
        self._check_peers()

    def row_losses(self) -> np.ndarray:
        """(B, T): with W ranks, every rank's rows gathered in batch order."""
        self._last("row_losses")
        ce = self._row_loss_buffer()
        return ce.get(stream=self.stream).reshape(self.batch, self.config.context)

    def gradients(self) -> np.ndarray:
        """G of the last step (before clipping), (N,) float32; with the
        state sharded, gathered from every rank's shard (every rank calls
        it, as state()). Under the memory plan G's segments share storage
        with the activations, which evaluate() uses: read G before an
        evaluation."""
        self._last("gradients")
        if self._gradient_overwritten:
            raise ReplayError("gradients: an evaluation since the last step used their storage "
                              "(the memory plan shares it with the activations); read them "
                              "before evaluate()")
        if self.buffers.shard is not None:  # the sum is in the shards: a collective
            return self._gathered(self.buffers.Gshard)
        return self.G.get(stream=self.stream)  # (N,)

    def grad_norm(self) -> float:
        self._last("grad_norm")
        return float(self.norm.get(stream=self.stream)[0])

    def evaluate(self, tokens) -> np.ndarray:
        """tokens (B, T+1) -> held-out row losses (B, T) with the current
        parameters; the forward-only graph is captured on first use."""
        tokens = self._local(check_tokens(self.config, self.batch, tokens, "evaluate input"))
        self._done.synchronize()  # a pending replay still uses the activations
        self._gradient_overwritten = self._gradient_shared
        if self.eval_ids is None:
            b, T = self.local_batch, self.config.context
            self.eval_ids = self.alloc((b, T + 1), np.int32)
            self.eval_ce = self.alloc((b * T,), np.float32)
            if self.world > 1:
                self.eval_rows = self.alloc((self.batch * T,), np.float32)
            self.eval_ids.set(tokens, stream=self.stream)
            with self.stream:
                self._evaluate()  # warm-up: the products' first use outside a capture
            if self.captured:
                with self.stream:  # the kernels must launch on the capturing stream
                    self.stream.begin_capture()
                    try:
                        self._evaluate()
                    finally:
                        self.eval_graph = self.stream.end_capture()
        self.eval_ids.set(tokens, stream=self.stream)
        if self.eval_graph is not None:
            self.eval_graph.launch(stream=self.stream)
        else:
            with self.stream:
                self._evaluate()
        rows = (self.eval_rows if self.world > 1 else self.eval_ce).get(stream=self.stream)
        self._check_peers()  # the read above waited for the evaluation
        return rows.reshape(self.batch, self.config.context)

    def state(self) -> State:
        """P, M and V copied into page-locked host memory (CuPy's pinned
        pool: a publication's copy runs at the link's speed, and its blocks
        return to the pool once the State is dropped), then t; one wait.
        With the state sharded, M and V are gathered from every rank first
        (_gathered): every rank calls state() at the same point."""
        self._done.synchronize()

        def get(a):
            out = pinned_empty(a.shape, a.dtype)
            a.get(stream=self.stream, out=out, blocking=False)
            return out

        if self.buffers.shard is not None:
            P = get(self.P)
            M, V = self._gathered(self.M), self._gathered(self.V)
        else:
            P, M, V = get(self.P), get(self.M), get(self.V)
        t = int(self.t.get(stream=self.stream)[0])  # waits, after the copies above
        return State(P, M, V, t)

    def _gathered(self, x) -> np.ndarray:
        """x, a (S,) shard of every rank (the sharded state's M, V or G) ->
        the whole (N,) on the host: an NCCL all-gather on the stream, outside
        the step, into a (W*S,) buffer of its own (back to CuPy's pool after),
        then a copy to page-locked host memory. A collective: every rank calls it, at
        the same point (accelerated/cuda/distributed.py)."""
        sh, N = self.buffers.shard, self.P.size
        with self.stream:
            whole = cupy.empty((self.world * sh.size,), dtype=np.float32)
        self.comm.all_gather(x, whole, self.stream.ptr)
        out = pinned_empty((N,), np.float32)
        whole[:N].get(stream=self.stream, out=out, blocking=False)
        self.stream.synchronize()
        self._check_peers()  # not the values of an aborted gather
        return out

    def logits(self, tokens) -> np.ndarray:
        """tokens (B', T') with T' <= T -> logits (B', T', V) with the current
        parameters: an eager forward on buffers of its own."""
        tokens = check_logits_tokens(self.config, tokens)
        B2, T2 = tokens.shape
        if self._eager is None or self._eager[:2] != (B2, T2):
            self._eager = None  # free the previous shape's buffers first
            op = np.uint16 if self.precision == "bf16" else np.float32
            acts = Activations(self.config, B2, T2, op, Buffers(self.stream), train=False)
            self._eager = (B2, T2, acts)
        acts = self._eager[2]
        ids = Buffers(self.stream).upload(tokens.astype(np.int32))
        self._done.synchronize()
        with self.stream:
            self.model.forward(acts, ids, T2)  # after any pending replay, on the same stream
        self.stream.synchronize()
        return acts.logits.get(stream=self.stream).reshape(B2, T2, self.config.vocab)

    def last_logits(self, window) -> np.ndarray:
        """window (1, n), n <= T -> the logits (V,) float32 at its last
        position with the current parameters, for sampling a token after
        another: the window padded with id 0 to its bucket (the next power
        of two from 64, at most T), whose buffers (and the attention's
        plans) stay, so that a whole generation takes at most log2(T)
        shapes; attention is causal, so the padding does not reach
        position n - 1. Only that row is read back."""
        tokens = check_logits_tokens(self.config, window)
        if tokens.shape[0] != 1:
            raise ReplayError(f"last_logits window {tokens.shape}: one row")
        n, T = tokens.shape[1], self.config.context
        L = min(T, max(64, 1 << (n - 1).bit_length()))
        if L not in self._windows:
            op = np.uint16 if self.precision == "bf16" else np.float32
            alloc = Buffers(self.stream)
            self._windows[L] = (Activations(self.config, 1, L, op, alloc, train=False),
                                alloc((1, L), np.int32))
        acts, ids = self._windows[L]
        padded = np.zeros((1, L), np.int32)
        padded[0, :n] = tokens[0]
        self._done.synchronize()
        with self.stream:
            ids.set(padded, stream=self.stream)
            self.model.forward(acts, ids, L)
        row = acts.logits[n - 1].get(stream=self.stream)
        self.stream.synchronize()
        return row

    def activations(self, tokens) -> dict:
        """tokens (B, T+1) -> every named intermediate of one step's forward
        and backward with the current parameters: an eager forward and
        backward on buffers of its own (every layer's kept, no memory plan,
        a gradient buffer of its own; no AdamW), so the program's state and
        last results stay as they are. The backward's intermediates are
        read as the step makes them (Model.tap): its buffers serve every
        layer in turn, as the logits' buffer serves every chunk of rows."""
        tokens = check_tokens(self.config, self.batch, tokens,
                              "activations input").astype(np.int32)
        c = self.config
        B, T = self.batch, c.context
        self._done.synchronize()  # a pending replay still uses the kernels' stream
        alloc = Buffers(self.stream)
        op = np.uint16 if self.precision == "bf16" else np.float32
        acts = Activations(c, B, T, op, alloc, train=True)
        G = Gradient.flat(alloc((registry(c).total,), np.float32), alloc)
        ids = alloc.upload(tokens)
        model = model_for(c, self.precision, self.kernels, self.blas, self.buffers, G)

        def read(buffer, part=None):  # -> (B, T, columns) float32 on the host
            x = _as_float32(buffer.get(stream=self.stream)).reshape(B * T, -1)
            if part is not None:  # a layout's Columns of the buffer's rows
                x = x[:, part.start:part.stop]
            return x.reshape(B, T, -1)

        out, chunks = {}, {"logits": [], "dlogits": []}

        def tap(name, buffer, part):
            if name in chunks:  # one chunk of rows at a time (Model.classifier_loss), in order
                chunks[name].append(_as_float32(buffer.get(stream=self.stream)))
            else:
                out[name] = read(buffer, part)

        model.tap = tap
        with self.stream:
            model.forward(acts, ids, T + 1)
            model.backward(acts, ids, T + 1)
        self.stream.synchronize()
        out["embedding.out"] = read(acts.x[0])
        for l in range(c.n_layer):
            p = f"layers.{l}."
            for part in "qkv":
                out[p + f"attn.{part}"] = read(acts.qkv[l], getattr(model.layout, part))
            out[p + "attn.y"] = read(acts.y[l])
            out[p + "mid"] = read(acts.x_mid[l])
            out[p + "mlp.gate"] = read(acts.gu[l], model.layout.gate)
            out[p + "mlp.up"] = read(acts.gu[l], model.layout.up)
            out[p + "out"] = read(acts.x[l + 1])
        out["final_norm.out"] = read(acts.hf)
        for name, parts in chunks.items():
            out[name] = np.concatenate(parts).reshape(B, T, -1)
        out["row_losses"] = read(acts.ce).reshape(B, T)
        return {name: out[name] for name, _ in activation_names(c)}

    def compilation_report(self) -> dict:
        return _report(self)

    def _partition_outcomes(self) -> list:
        return _partition_outcomes(self)

    def _executable_nodes(self):
        # the dry run's commands: the warm-up checked that the real step's agree
        return [c.operations for c in self.plan.commands], ""

    def _executable_plan(self) -> list:
        plan = self.plan
        return [{"node": c.index, "kind": c.kind, "name": c.name, "launch": c.launch,
                 "operations": list(c.operations),
                 "buffers": [plan.buffers[i].name for i in plan.touches[c.index]]}
                for c in plan.commands]

    def _memory_analysis(self) -> MemoryAnalysis:
        return _memory_analysis(self)

    def _runtime(self) -> dict:
        """The runtime part of diagnostics() (the base's): versions, device, memory."""
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        free, total = cupy.cuda.runtime.memGetInfo()
        return {
            "cupy_version": cupy.__version__,
            "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
            "cublas_version": self.blas.version,
            "cublas_library": cublas.LOADED_FROM,
            "cudnn": {**cudnn_attention.versions(), "attention": self.acts.path.kind,
                      "reason": self.acts.path.reason},
            "device": props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
            "update_count": int(self.t.get(stream=self.stream)[0]),  # a sync: not in the loop
            "device_free_bytes": int(free),
            "device_total_bytes": int(total),
        }


def capture(config: Config, hyper: Hyper, precision: str, batch: int, state: State,
            accumulate: int | None = None, comm=None, recompute=None,
            shard: bool = False) -> CupyProgram:
    """Allocate, warm up and capture the step once; performs no training update.
    `accumulate` k (default: hyper.accumulate): SPEC 19's micro-batches, the
    activations sized for B/k. `comm`: this rank's communicator of W ranks
    (accelerated.distributed.Communicator; every rank captures at once, on
    its own device): the program is rank r's part of the global batch B,
    the activations sized for B/(W*k) (SPEC 19). `recompute`
    (reference/contract.py recompute_mode: None or False off, "gate-up" or
    True, "block"): each layer's gate and up products, or its whole
    forward from its input, are computed again in the backward instead of
    kept per layer (the same bits; less memory, more time). `shard`: with W > 1
    ranks, each keeps M and V of its 1/W shard of the parameters alone, the
    gradient reduce-scattered and the updated parameters all-gathered in the
    step (SPEC 23); with one rank nothing changes."""
    if not available():
        raise RunError("backend 'cupy': CuPy or a CUDA device is not available here")
    return CupyProgram(config, hyper, precision, batch, state, accumulate, comm, recompute, shard)
