"""Launch and rendezvous of data-parallel ranks (SPEC 19).

W ranks, one process per GPU. Who starts them:

- `coppelius train --gpus N` (or `bench --gpus N`) on one host: this
  process starts N copies of its own command line (spawned: new
  interpreters, not forks), each with the variables torchrun would set
  (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1, MASTER_PORT), in
  sessions of their own, forwards SIGINT, SIGTERM and SIGHUP to them once,
  and watches them (`spawn`).
- a launcher, on one host or several: torchrun (RANK, WORLD_SIZE,
  LOCAL_RANK, MASTER_ADDR, MASTER_PORT), mpirun (OMPI_COMM_WORLD_RANK,
  _SIZE, _LOCAL_RANK, or PMI_RANK, PMI_SIZE and MPI_LOCALRANKID), srun
  (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; MASTER_ADDR or the first host
  of the node list, MASTER_PORT or a port from the job id). The same
  command reads them (`from_environment`).

The ranks then meet (`Group.open`): rank 0 listens at MASTER_ADDR:MASTER_PORT
and the others connect, as llm.c's ranks exchange the NCCL unique id; under
MPI, rank 0's address and later the unique id go by mpi4py's bcast. The
connections stay open as the control channel, with length-prefixed JSON
messages:

1. hello: every rank says who it is (rank, world, host, pid);
2. the plan: rank 0 makes its plan and sends it (or its refusal); every
   other rank makes its own and answers whether it agrees (same identities,
   batch, step, contexts, ...); rank 0 then sends "go" with the NCCL unique
   id, or one refusal that every rank obeys (exit 2, printed once, by rank 0);
3. while training, `watch`: a rank that fails sends "failed" with its
   reason; a rank whose process dies closes its connection. Rank 0 passes
   either on to the others; every rank's watcher then calls its failure
   handler (the NCCL communicator's abort, so that no rank hangs in a
   collective), and, if the process has not ended by itself within
   ABORT_GRACE seconds, ends it (os._exit). A rank that ends normally says
   "done" first.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from coppelius.reference.errors import RunError

PROTOCOL = "coppelius-ranks-v1"
MAX_MESSAGE = 1 << 20  # bytes of one control message
RENDEZVOUS_TIMEOUT = 300.0  # s for every rank to join (a rank's start includes its imports)
PLAN_TIMEOUT = 3600.0  # s for a plan (rank 0 may tokenize a corpus first)
ABORT_GRACE = 15.0  # s a failed rank's process has to end by itself before it is ended
EXIT_GRACE = 30.0  # s a rank that is done has to exit before it is ended (teardown)
PARENT_ENV = "COPPELIUS_RANKS_PARENT"  # set by `--gpus N` in the ranks it starts
PARENT_GRACE = 30.0  # s the --gpus parent gives the others after a rank failed, then SIGKILL


class PeerFailure(RunError):
    """Another rank failed (raised, or its process died): this one stopped."""


@dataclass(frozen=True)
class Launch:
    """This process's place among the ranks."""

    rank: int
    world: int
    local_rank: int | None  # the GPU on this host (None: rank modulo the GPUs here)
    addr: str | None  # rank 0's control channel (None under MPI: told by bcast)
    port: int | None
    launcher: str  # torchrun (also --gpus), mpi, slurm
    agent_store: str | None = None  # torchrun's agent store holds MASTER_PORT: its key prefix


# ---------------------------------------------------------------- the environment

def _int(env, name, low=0):
    value = env.get(name)
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = None
    if n is None or n < low:
        raise RunError(f"{name}={value!r}: not a {'rank' if low == 0 else 'count'} "
                       f"(an integer >= {low})")
    return n


def _check(rank, world, rank_name, world_name):
    if rank >= world:
        raise RunError(f"{rank_name}={rank}: not below {world_name}={world}")


def _port(env, name, value=None):
    value = env.get(name) if value is None else value
    try:
        port = int(value)
    except (TypeError, ValueError):
        port = 0
    if not 0 < port < 65536:
        raise RunError(f"{name}={value!r}: not a TCP port (1 to 65535)")
    return port


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: "gpu[03-04,07],cpu1" -> "gpu03"
    (each bracket takes its first number, zero-padding kept)."""
    out, depth, i = [], 0, 0
    while i < len(nodelist):
        ch = nodelist[i]
        if ch == "," and depth == 0:
            break
        if ch == "[":
            end = nodelist.find("]", i)
            if end < 0:
                raise RunError(f"node list {nodelist!r}: unbalanced brackets")
            out.append(nodelist[i + 1:end].split(",")[0].split("-")[0])
            i = end + 1
            continue
        out.append(ch)
        i += 1
    host = "".join(out).strip()
    if not host:
        raise RunError(f"node list {nodelist!r}: no host")
    return host


def from_environment(env=None) -> Launch | None:
    """This process's Launch from a launcher's variables, or None when no
    launcher started it or it is the only rank. MPI's variables first
    (mpirun may run inside a Slurm allocation), then torchrun's (also under
    srun), then Slurm's."""
    env = os.environ if env is None else env
    if "OMPI_COMM_WORLD_SIZE" in env or "PMI_SIZE" in env:
        ompi = "OMPI_COMM_WORLD_SIZE" in env
        size_name = "OMPI_COMM_WORLD_SIZE" if ompi else "PMI_SIZE"
        rank_name = "OMPI_COMM_WORLD_RANK" if ompi else "PMI_RANK"
        world, rank = _int(env, size_name, 1), _int(env, rank_name)
        _check(rank, world, rank_name, size_name)
        local = next((n for n in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
                                  "PMI_LOCAL_RANK") if n in env), None)
        local_rank = _int(env, local) if local else None
        return None if world == 1 else Launch(rank, world, local_rank, None, None, "mpi")
    if "WORLD_SIZE" in env:
        world = _int(env, "WORLD_SIZE", 1)
        if world == 1:
            return None
        rank = _int(env, "RANK")
        _check(rank, world, "RANK", "WORLD_SIZE")
        local_rank = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else None
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if not env.get(name):
                raise RunError(f"{name}: not set (WORLD_SIZE={world} ranks meet at rank 0's "
                               f"MASTER_ADDR:MASTER_PORT)")
        # torchrun (c10d rendezvous) may serve its own store at MASTER_PORT, in
        # which case rank 0 listens elsewhere and says where through that store
        agent = (f"coppelius/{env.get('TORCHELASTIC_RUN_ID', '')}/"
                 f"{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/control"
                 if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else None)
        return Launch(rank, world, local_rank, env["MASTER_ADDR"], _port(env, "MASTER_PORT"),
                      "torchrun", agent)
    if "SLURM_NTASKS" in env and "SLURM_PROCID" in env:
        size_name = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
        world, rank = _int(env, size_name, 1), _int(env, "SLURM_PROCID")
        if world == 1:
            return None
        _check(rank, world, "SLURM_PROCID", size_name)
        local_rank = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else None
        addr = env.get("MASTER_ADDR")
        if not addr:
            nodes = next((env[n] for n in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST",
                                           "SLURM_NODELIST") if env.get(n)), None)
            if nodes is None:
                raise RunError("MASTER_ADDR: not set, and no SLURM_JOB_NODELIST to take rank "
                               "0's host from")
            addr = first_host(nodes)
        if env.get("MASTER_PORT"):
            port = _port(env, "MASTER_PORT")
        else:  # the same on every task of the job, and apart from other jobs' on the host
            port = 20000 + _int(env, "SLURM_JOB_ID") % 20000
        return Launch(rank, world, local_rank, addr, port, "slurm")
    return None


# ---------------------------------------------------------------- the control channel

def _send(sock, message: dict) -> None:
    body = json.dumps(message).encode("utf-8")
    sock.sendall(struct.pack(">I", len(body)) + body)


def _recv_exactly(sock, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _recv_within(sock, timeout: float) -> dict | None:
    """_recv with a deadline; the socket blocks again afterwards."""
    sock.settimeout(timeout)
    try:
        return _recv(sock)
    finally:
        sock.settimeout(None)


def _recv(sock) -> dict | None:
    """One message; None when the peer closed the connection (or it broke)."""
    try:
        head = _recv_exactly(sock, 4)
        if head is None:
            return None
        (n,) = struct.unpack(">I", head)
        if n > MAX_MESSAGE:
            return None
        body = _recv_exactly(sock, n)
        if body is None:
            return None
        message = json.loads(body.decode("utf-8"))
        return message if isinstance(message, dict) else None
    except (OSError, ValueError):
        return None


class Group:
    """The ranks' control channel (module docstring). Rank 0 holds one
    connection per other rank; every other rank one connection to rank 0."""

    def __init__(self, launch: Launch, peers: dict, mpi=None, listener=None):
        self.launch = launch
        self.rank, self.world = launch.rank, launch.world
        self.peers = peers  # rank -> socket (rank 0), or {0: socket}
        self.who = {}  # rank -> "host pid" as the hello said
        self.mpi = mpi
        self._listener = listener
        self._done = set()  # ranks that said done
        self._closing = False
        self._failed = threading.Event()
        self._send_lock = threading.Lock()
        self._watcher = None

    # -- opening

    @classmethod
    def open(cls, launch: Launch, timeout: float = RENDEZVOUS_TIMEOUT, mpi=None,
             bind: str | None = None, store=None) -> "Group":
        """Meet every rank. Under MPI (launch.launcher "mpi"), rank 0's
        address goes to the others by bcast over `mpi` (mpi4py's
        COMM_WORLD unless given); under torchrun's agent store (which holds
        MASTER_PORT) it goes through that store (`store`: a
        torch.distributed.TCPStore client unless given). `bind`: the
        address rank 0 listens on (default: every interface; the --gpus
        ranks use 127.0.0.1)."""
        addr, port = launch.addr, launch.port
        if launch.agent_store is not None and store is None:
            store = _agent_store(addr, port, timeout)
        if launch.launcher == "mpi":
            if mpi is None:
                try:
                    from mpi4py import MPI
                except ImportError:
                    raise RunError("launched by MPI: the ranks meet through mpi4py, which is "
                                   "not installed here (pip install mpi4py)") from None
                mpi = MPI.COMM_WORLD
            if mpi.Get_rank() != launch.rank or mpi.Get_size() != launch.world:
                raise RunError(f"MPI says rank {mpi.Get_rank()} of {mpi.Get_size()}, the "
                               f"environment rank {launch.rank} of {launch.world}")
        told = mpi is not None or store is not None  # rank 0's address is told, not agreed
        if launch.rank == 0:
            listener = _listen(bind if bind is not None else "", 0 if told else port, launch)
            if mpi is not None:
                host = os.environ.get("MASTER_ADDR") or socket.gethostname()
                mpi.bcast((host, listener.getsockname()[1]), root=0)
            elif store is not None:
                store.set(launch.agent_store,
                          f"{_address_towards(addr, port)} {listener.getsockname()[1]}")
            try:
                group = cls(launch, {}, mpi, listener)
                group._accept(timeout)
            except BaseException:
                listener.close()
                raise
            return group
        if mpi is not None:
            addr, port = mpi.bcast(None, root=0)
        elif store is not None:  # waits until rank 0 has set it
            host, number = bytes(store.get(launch.agent_store)).decode().split()
            addr, port = host, int(number)
        sock = _connect(addr, port, launch, timeout)
        _send(sock, {"protocol": PROTOCOL, "rank": launch.rank, "world": launch.world,
                     "host": socket.gethostname(), "pid": os.getpid()})
        return cls(launch, {0: sock}, mpi)

    def _accept(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.peers) < self.world - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(1, self.world)) - set(self.peers))
                raise RunError(f"rendezvous at port {self._listener.getsockname()[1]}: rank"
                               f"{'s' if len(missing) > 1 else ''} "
                               f"{', '.join(map(str, missing))} did not join within "
                               f"{timeout:.0f} s")
            self._listener.settimeout(left)
            try:
                sock, _ = self._listener.accept()
            except socket.timeout:
                continue
            sock.settimeout(min(10.0, max(left, 0.1)))
            hello = _recv(sock)
            sock.settimeout(None)
            if not hello or hello.get("protocol") != PROTOCOL:
                sock.close()  # not one of ours: ignored
                continue
            r, world = hello.get("rank"), hello.get("world")
            if world != self.world:
                self._refuse_now(sock, f"rank {r} was started with {world} ranks, rank 0 with "
                                       f"{self.world}")
            if not isinstance(r, int) or not 0 < r < self.world or r in self.peers:
                self._refuse_now(sock, f"two ranks call themselves rank {r}")
            self.peers[r] = sock
            self.who[r] = f"{hello.get('host')} pid {hello.get('pid')}"

    def _refuse_now(self, sock, reason: str) -> None:
        for s in [sock, *self.peers.values()]:
            try:
                _send(s, {"refuse": reason, "status": 2})
            except OSError:
                pass
        raise RunError(reason)

    # -- the plan

    def share(self, message: dict) -> None:
        """Rank 0: one message to every other rank."""
        assert self.rank == 0
        for sock in self.peers.values():
            try:
                _send(sock, message)
            except OSError:
                pass  # that rank is gone: the next receive from it says so

    def receive(self, timeout: float = PLAN_TIMEOUT) -> dict:
        """A rank > 0: rank 0's next message."""
        message = _recv_within(self.peers[0], timeout)
        if message is None:
            raise PeerFailure("rank 0 ended before the run started")
        return message

    def reply(self, message: dict) -> None:
        """A rank > 0: a message to rank 0."""
        _send(self.peers[0], message)

    def gather(self, timeout: float = PLAN_TIMEOUT) -> dict:
        """Rank 0: every other rank's next message, by rank."""
        out = {}
        for r, sock in sorted(self.peers.items()):
            message = _recv_within(sock, timeout)
            if message is None:
                message = {"refuse": f"rank {r} ({self.who.get(r)}) ended before the run "
                                     f"started", "status": 2}
            out[r] = message
        return out

    def go(self, make) -> bytes:
        """Rank 0, once every rank agreed: "go" to the others, and the NCCL
        unique id (`make()`) to every rank -- in the "go" message, or by
        mpi4py's bcast under MPI. -> the id."""
        assert self.rank == 0
        uid = make()
        self.share({"go": "" if self.mpi is not None else uid.hex()})
        if self.mpi is not None:
            self.mpi.bcast(uid, root=0)
        return uid

    def went(self, message: dict) -> bytes:
        """A rank > 0, given rank 0's "go" message: the NCCL unique id."""
        if self.mpi is not None:
            return bytes(self.mpi.bcast(None, root=0))
        return bytes.fromhex(message["go"])

    # -- while training

    def watch(self, on_failure, hard_exit: bool = True, status: int = 2,
              say=None) -> None:
        """From now on, a failure of another rank calls on_failure(PeerFailure)
        once (on the watcher's thread); with `hard_exit`, the process is
        ended with `status` if it is still running ABORT_GRACE seconds
        later (after `say(message)`, when given)."""
        def failed(reason: str):
            if self._closing or self._failed.is_set():
                return
            self._failed.set()
            failure = PeerFailure(f"stopped: {reason}")
            if self.rank == 0:  # tell the others, and who
                for r, sock in self.peers.items():
                    if r not in self._done:
                        try:
                            with self._send_lock:
                                _send(sock, {"failed": reason})
                        except OSError:
                            pass
            if hard_exit:  # first: on_failure may block (a communicator's teardown)
                def end():
                    time.sleep(ABORT_GRACE)
                    if say is not None:
                        say(str(failure))
                    os._exit(status)

                threading.Thread(target=end, name="coppelius-rank-end", daemon=True).start()
            on_failure(failure)

        def run():
            selector = selectors.DefaultSelector()
            for r, sock in self.peers.items():
                selector.register(sock, selectors.EVENT_READ, r)
            while not self._closing and selector.get_map():
                try:
                    events = selector.select(timeout=0.5)
                except (OSError, ValueError):
                    return  # closed under us: close() was called
                for key, _ in events:
                    r = key.data
                    message = _recv(key.fileobj)
                    if self._closing:
                        return
                    if message is None or "failed" in message:
                        selector.unregister(key.fileobj)
                        if message is not None:
                            failed(message["failed"])
                        elif r not in self._done:
                            who = f" ({self.who[r]})" if r in self.who else ""
                            failed(f"rank {r}{who} ended unexpectedly (its process died or was "
                                   f"killed)")
                    elif message.get("done"):
                        self._done.add(r)

        self._watcher = threading.Thread(target=run, name="coppelius-rank-watch", daemon=True)
        self._watcher.start()

    @property
    def failed(self) -> bool:
        return self._failed.is_set()

    def fail(self, reason: str) -> None:
        """Tell the others this rank failed, and why (rank 0 tells them all)."""
        if self._failed.is_set():
            return  # the failure came from elsewhere: they know
        self._failed.set()
        self._tell_all({"failed": reason})

    def finish(self) -> None:
        """This rank ends normally: the others are told, the watcher stops."""
        self._closing = True
        self._tell_all({"done": True})

    def _tell_all(self, message: dict) -> None:
        """The message to every peer; a peer already gone is passed over."""
        for sock in self.peers.values():
            try:
                with self._send_lock:
                    _send(sock, message)
            except OSError:
                pass

    def close(self) -> None:
        self._closing = True
        for sock in self.peers.values():
            try:
                sock.close()
            except OSError:
                pass
        if self._listener is not None:
            self._listener.close()


def exit_within(status: int, seconds: float = EXIT_GRACE) -> None:
    """A rank whose work is done and written: if the process has not exited
    `seconds` from now (the teardown of CUDA or NCCL waiting for a rank
    that is gone), it is ended with `status`."""
    def end():
        time.sleep(seconds)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(status)

    threading.Thread(target=end, name="coppelius-rank-exit", daemon=True).start()


def _agent_store(addr: str, port: int, timeout: float):
    """A client of torchrun's agent store at MASTER_ADDR:MASTER_PORT."""
    from datetime import timedelta

    try:
        from torch.distributed import TCPStore
    except ImportError:
        raise RunError("TORCHELASTIC_USE_AGENT_STORE=True: torchrun's store is reached through "
                       "torch, which is not importable here") from None
    return TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout))


def _address_towards(addr: str, port: int) -> str:
    """This host's address on the route to addr (others reach it the same way)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((addr, port))  # a datagram socket sends nothing to connect
            return s.getsockname()[0]
    except OSError:
        return socket.gethostname()


def _listen(bind: str, port: int, launch: Launch):
    try:
        listener = socket.create_server((bind, port), reuse_port=False)
    except OSError as e:
        raise RunError(f"MASTER_PORT={port}: rank 0 cannot listen there "
                       f"({e.strerror or e})") from None
    listener.listen(max(16, launch.world))
    return listener


def _connect(addr, port, launch: Launch, timeout: float):
    """Connect to rank 0, retrying until it listens or `timeout` runs out."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            return socket.create_connection((addr, port), timeout=5)
        except OSError as e:
            last = e
            time.sleep(0.1)
    raise RunError(f"rank {launch.rank}: cannot reach rank 0 at {addr}:{port} within "
                   f"{timeout:.0f} s ({getattr(last, 'strerror', None) or last}; check "
                   f"MASTER_ADDR and MASTER_PORT)")


# ---------------------------------------------------------------- --gpus N on one host

def free_port() -> int:
    """A TCP port nothing listens on now, on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_environments(n: int, port: int, base=None) -> list:
    """The variables of each of n ranks on this host, as torchrun sets them."""
    base = dict(os.environ if base is None else base)
    out = []
    for r in range(n):
        env = dict(base, RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env[PARENT_ENV] = "1"
        env.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (SPEC 19)
        out.append(env)
    return out


def _own_session() -> dict:
    """Popen's arguments for a rank: a session of its own (the terminal's
    signals come through this process, once), and on Linux SIGTERM when
    this process dies, however it dies, so that no rank outlives it."""
    if not sys.platform.startswith("linux"):
        return {"start_new_session": True}

    def child():  # runs in the child between fork and exec
        import ctypes

        os.setsid()
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent died before prctl: no signal would come
            os.kill(os.getpid(), signal.SIGTERM)

    return {"preexec_fn": child}


def spawn(command: list, n: int, what: str = "train", grace: float = PARENT_GRACE,
          env=None) -> int:
    """Run n ranks of `command` (an argv list, started as is) on this host
    and wait for them. SIGINT, SIGTERM and SIGHUP reach each rank once,
    through this process (the ranks run in sessions of their own, apart
    from the terminal's signals). A rank that ends with a failure gives the
    others `grace` seconds to end by themselves (they are told through the
    control channel), then they are killed. -> the exit status: 0, or the
    first failed rank's (128 + N for a rank ended by signal N, which is
    reported here in one line: the rank could not say it)."""
    envs = rank_environments(n, free_port(), env)
    procs = []
    forwarded = {}

    def forward(signum, frame):
        for p in procs:
            if p.poll() is None:
                try:
                    p.send_signal(signum)
                except OSError:
                    pass
        forwarded[signum] = True

    old = {}
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        try:
            old[sig] = signal.signal(sig, forward)
        except ValueError:  # not the main thread
            pass
    try:
        for r in range(n):
            procs.append(subprocess.Popen(command, env=envs[r], **_own_session()))
        first = None  # (rank, status) of the first rank that failed
        failed_at = None
        while True:
            codes = [p.poll() for p in procs]
            for r, code in enumerate(codes):
                if code not in (None, 0) and first is None:
                    first, failed_at = (r, code), time.monotonic()
            if all(c is not None for c in codes):
                break
            if failed_at is not None and time.monotonic() - failed_at > grace:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.05)
    finally:
        for p in procs:  # this process is leaving (an exception): its ranks do too
            if p.poll() is None:
                p.kill()
                p.wait()
        for sig, handler in old.items():
            signal.signal(sig, handler)
    if first is None:
        return 0
    r, code = first
    if code < 0:
        print(f"coppelius {what}: error: rank {r} (pid {procs[r].pid}) ended by signal "
              f"{-code}; the other ranks were stopped", file=sys.stderr, flush=True)
        return 128 - code
    return code
