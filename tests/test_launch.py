"""Launch and rendezvous of data-parallel ranks (SPEC 19, coppelius/launch.py):
the launchers' environments (torchrun, MPI, Slurm), the control channel on
real sockets on localhost (ranks as threads), the NCCL id through MPI's
bcast, failure reports, the `--gpus N` parent watching its ranks, and the
refusals of `--gpus` where it does not apply. The training itself on ranks
is tested on the emulated CUDA backend (test_data_parallel_emulated.py)."""

import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from coppelius import launch as ranks
from coppelius.cli import main
from coppelius.launch import Launch, first_host, from_environment
from coppelius.reference.errors import RunError

from tests.support import on_threads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- the environment

def test_no_launcher_or_one_rank_is_a_single_process():
    assert from_environment({}) is None
    assert from_environment({"WORLD_SIZE": "1", "RANK": "0"}) is None
    assert from_environment({"OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0"}) is None
    assert from_environment({"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) is None


def test_torchrun():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "node7",
           "MASTER_PORT": "29500"}
    assert from_environment(env) == Launch(3, 4, 1, "node7", 29500, "torchrun")


def test_open_mpi_and_pmi():
    env = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    assert from_environment(env) == Launch(5, 8, 1, None, None, "mpi")
    env = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0"}
    assert from_environment(env) == Launch(2, 4, 0, None, None, "mpi")
    # no local rank: the GPU is then the rank modulo the GPUs of the host
    assert from_environment({"PMI_RANK": "2", "PMI_SIZE": "4"}).local_rank is None


def test_slurm_takes_the_first_host_and_a_port_from_the_job():
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
           "SLURM_JOB_NODELIST": "gpu[03-04,07],cpu1", "SLURM_JOB_ID": "123456"}
    assert from_environment(env) == Launch(1, 4, 1, "gpu03", 20000 + 123456 % 20000, "slurm")
    env.update(MASTER_ADDR="head", MASTER_PORT="29400")
    assert from_environment(env) == Launch(1, 4, 1, "head", 29400, "slurm")
    # the step's task count over the job's
    env.update(SLURM_STEP_NUM_TASKS="2")
    assert from_environment(env).world == 2


def test_which_launcher_wins():
    slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1",
             "SLURM_JOB_ID": "9"}
    torchrun = {"RANK": "1", "WORLD_SIZE": "8", "MASTER_ADDR": "a", "MASTER_PORT": "1234"}
    mpi = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}
    assert from_environment({**slurm, **torchrun}).launcher == "torchrun"  # torchrun under srun
    assert from_environment({**slurm, **mpi}).launcher == "mpi"  # mpirun in an allocation


@pytest.mark.parametrize("host_list, first", [
    ("node01", "node01"), ("node[01-04]", "node01"), ("gpu[7,3-4],cpu1", "gpu7"),
    ("rack[2-3]-n[010-012]", "rack2-n010"), ("a,b", "a"), ("x[5]", "x5")])
def test_first_host_of_a_node_list(host_list, first):
    assert first_host(host_list) == first


@pytest.mark.parametrize("env, words", [
    ({"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "RANK='x'"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"},
     "RANK=2: not below WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"}, "MASTER_ADDR: not set"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "70000"},
     "MASTER_PORT='70000': not a TCP port"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE='0'"),
    ({"OMPI_COMM_WORLD_RANK": "4", "OMPI_COMM_WORLD_SIZE": "4"},
     "OMPI_COMM_WORLD_RANK=4: not below OMPI_COMM_WORLD_SIZE=4"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "1"}, "no SLURM_JOB_NODELIST"),
])
def test_bad_launcher_variables_are_named(env, words):
    with pytest.raises(RunError) as e:
        from_environment(env)
    assert words in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------- the control channel

def open_group(n, port=None, **kw):
    port = port or ranks.free_port()
    return on_threads(n, lambda r: ranks.Group.open(Launch(r, n, None, "127.0.0.1", port,
                                                           "torchrun"), **kw))


def test_ranks_meet_exchange_the_plan_and_the_id_over_sockets():
    groups = open_group(3)

    def flow(r):
        g = groups[r]
        if r == 0:
            g.share({"plan": {"batch": 8}})
            verdicts = g.gather()
            return verdicts, g.go(lambda: bytes(range(128)))
        plan = g.receive()["plan"]
        g.reply({"agree": plan["batch"] + r})
        return plan, g.went(g.receive())

    out = on_threads(3, flow)
    assert out[0][0] == {1: {"agree": 9}, 2: {"agree": 10}}
    assert out[1][0] == out[2][0] == {"batch": 8}
    assert out[0][1] == out[1][1] == out[2][1] == bytes(range(128))
    assert {groups[0].who[r].split()[-1] for r in (1, 2)} == {str(os.getpid())}
    for g in groups:
        g.close()


class FakeMPI:
    """COMM_WORLD's Get_rank, Get_size and bcast, for ranks that are threads."""

    def __init__(self, n):
        self.n, self.barrier, self.value = n, threading.Barrier(n), None

    def rank(self, r):
        world = self

        class Comm:
            def Get_rank(self):
                return r

            def Get_size(self):
                return world.n

            def bcast(self, value, root=0):
                if r == root:
                    world.value = value
                world.barrier.wait()
                got = world.value
                world.barrier.wait()
                return got

        return Comm()


def test_under_mpi_the_address_and_the_nccl_id_go_by_bcast():
    mpi = FakeMPI(2)

    def flow(r):
        g = ranks.Group.open(Launch(r, 2, None, None, None, "mpi"), mpi=mpi.rank(r))
        try:
            if r == 0:
                return g.go(lambda: b"\x07" * 128)
            message = g.receive()
            assert message["go"] == ""  # the id itself did not go over the socket
            return g.went(message)
        finally:
            g.close()

    assert on_threads(2, flow) == [b"\x07" * 128] * 2


class FakeStore:
    """torch.distributed.TCPStore's set and get (get waits for the key)."""

    def __init__(self):
        self.values, self.cond = {}, threading.Condition()

    def set(self, key, value):
        with self.cond:
            self.values[key] = value.encode() if isinstance(value, str) else value
            self.cond.notify_all()

    def get(self, key):
        with self.cond:
            self.cond.wait_for(lambda: key in self.values, timeout=10)
            return self.values[key]


def test_under_torchruns_agent_store_rank_zero_says_where_it_listens():
    """torchrun's agent holds MASTER_PORT with its own store: rank 0 listens
    on a port of its own and writes its address into that store."""
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
           "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "job",
           "TORCHELASTIC_RESTART_COUNT": "1"}
    key = from_environment(env).agent_store
    assert key == "coppelius/job/1/control"
    store = FakeStore()
    held = socket.create_server(("127.0.0.1", 0))  # the agent's store, on MASTER_PORT
    port = held.getsockname()[1]

    def flow(r):
        g = ranks.Group.open(Launch(r, 2, None, "127.0.0.1", port, "torchrun", key), store=store)
        try:
            return g.go(lambda: b"\x01" * 128) if r == 0 else g.went(g.receive())
        finally:
            g.close()

    assert on_threads(2, flow) == [b"\x01" * 128] * 2
    host, listened = store.values[key].decode().split()
    assert host == "127.0.0.1" and int(listened) != port
    held.close()


def test_a_rank_started_with_another_world_size_is_refused():
    port = ranks.free_port()

    def flow(r):
        world = 2 if r == 0 else 3
        if r == 0:
            return ranks.Group.open(Launch(0, 2, None, "127.0.0.1", port, "torchrun"))
        g = ranks.Group.open(Launch(1, world, None, "127.0.0.1", port, "torchrun"))
        return g.receive()

    with pytest.raises(RunError, match="rank 1 was started with 3 ranks, rank 0 with 2"):
        on_threads(2, flow)


def test_a_missing_rank_is_named_after_the_timeout():
    with pytest.raises(RunError, match="rank 1 did not join within 1 s"):
        ranks.Group.open(Launch(0, 2, None, "127.0.0.1", ranks.free_port(), "torchrun"),
                         timeout=1)
    with pytest.raises(RunError, match="cannot reach rank 0 at 127.0.0.1"):
        ranks.Group.open(Launch(1, 2, None, "127.0.0.1", ranks.free_port(), "torchrun"),
                         timeout=0.5)


def watched(groups, skip=()):
    """Start every group's watcher (but those in skip): {rank: [failure]}, events."""
    seen = {r: [] for r in range(len(groups))}
    events = {r: threading.Event() for r in range(len(groups))}
    for r, g in enumerate(groups):
        if r in skip:
            continue

        def on_failure(failure, r=r):
            seen[r].append(str(failure))
            events[r].set()

        g.watch(on_failure, hard_exit=False)
    return seen, events


def test_a_rank_that_dies_is_reported_to_every_rank():
    groups = open_group(3)
    seen, events = watched(groups, skip=(2,))
    for sock in groups[2].peers.values():  # rank 2's process dies: its socket closes
        sock.close()
    assert events[0].wait(5) and events[1].wait(5)
    assert seen[0] == seen[1] and len(seen[0]) == 1
    assert "stopped: rank 2 (" in seen[0][0] and "ended unexpectedly" in seen[0][0]
    for g in groups:
        g.close()


def test_a_rank_that_fails_says_why_and_rank_zero_passes_it_on():
    groups = open_group(3)
    seen, events = watched(groups)
    groups[2].fail("rank 2 failed: out of memory")
    assert events[0].wait(5) and events[1].wait(5)
    assert seen[0] == seen[1] == ["stopped: rank 2 failed: out of memory"]
    assert not seen[2]  # its own failure is not reported back to it
    for g in groups:
        g.close()


def test_ranks_that_end_normally_are_not_failures():
    groups = open_group(3)
    seen, events = watched(groups)
    for g in groups[1:]:
        g.finish()
        g.close()
    groups[0].finish()
    time.sleep(1.0)
    assert seen == {0: [], 1: [], 2: []}
    groups[0].close()


def test_a_peer_that_is_not_a_rank_is_ignored():
    port = ranks.free_port()

    def flow(r):
        if r == 1:
            time.sleep(0.2)
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(b"GET / HTTP/1.0\r\n\r\n")
            return ranks.Group.open(Launch(1, 2, None, "127.0.0.1", port, "torchrun"))
        return ranks.Group.open(Launch(0, 2, None, "127.0.0.1", port, "torchrun"))

    groups = on_threads(2, flow)
    assert set(groups[0].peers) == {1}
    for g in groups:
        g.close()


# ---------------------------------------------------------------- --gpus N: the parent

CHILD = """
import os, signal, sys, time
r = int(os.environ["RANK"])
print(f"rank {r} of {os.environ['WORLD_SIZE']} local {os.environ['LOCAL_RANK']} "
      f"at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} "
      f"nvls {os.environ['NCCL_NVLS_ENABLE']} parent {os.environ['COPPELIUS_RANKS_PARENT']}",
      flush=True)
mode = sys.argv[1]
if mode == "ok":
    sys.exit(0)
if mode == "fail" and r == 1:
    sys.exit(3)
if mode == "kill" and r == 1:
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "term":
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
    print(f"ready {os.getpid()}", flush=True)
time.sleep(60)
"""


def spawn_children(mode, n=2, grace=1.0, capfd=None):
    command = [sys.executable, "-c", CHILD, mode]
    return ranks.spawn(command, n, grace=grace)


def test_the_parent_starts_each_rank_with_its_variables(capfd):
    assert spawn_children("ok", n=3) == 0
    out = capfd.readouterr().out
    for r in range(3):
        assert f"rank {r} of 3 local {r} at 127.0.0.1:" in out
    assert out.count("nvls 0 parent 1") == 3
    # one address for all (the lines the children print; another process's
    # warning may share the captured output)
    assert len({line.split(" at ")[1].split()[0] for line in out.splitlines()
                if line.startswith("rank ") and " at " in line}) == 1


def test_a_failed_rank_ends_the_others_and_its_status_is_the_parents(capfd):
    t0 = time.monotonic()
    assert spawn_children("fail", grace=1.0) == 3
    assert time.monotonic() - t0 < 15  # rank 0 sleeps 60 s: ended after the grace


def test_a_rank_killed_by_a_signal_is_reported_in_one_line(capfd):
    t0 = time.monotonic()
    assert spawn_children("kill", grace=1.0) == 128 + 9
    assert time.monotonic() - t0 < 15
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rank 1 (pid" in err[0] and "ended by signal 9" in err[0], err


def start_parent(tmp_path) -> subprocess.Popen:
    """A process running launch.spawn of two CHILD ranks in 'term' mode
    (each prints "ready", then waits for a signal); its stdout is piped."""
    script = tmp_path / "parent.py"
    script.write_text(f"import sys; sys.path.insert(0, {ROOT!r})\n"
                      "from coppelius import launch\n"
                      f"sys.exit(launch.spawn([sys.executable, '-c', {CHILD!r}, 'term'], 2))\n")
    return subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)


def test_the_parent_forwards_a_signal_to_each_rank_once(tmp_path):
    p = start_parent(tmp_path)
    ready = 0
    while ready < 2:
        ready += p.stdout.readline().startswith("ready")
    p.send_signal(15)
    assert p.wait(20) == 143


def ended(pid) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_no_rank_outlives_a_parent_that_is_killed(tmp_path):
    p = start_parent(tmp_path)
    pids = []
    while len(pids) < 2:
        line = p.stdout.readline()
        if line.startswith("ready"):
            pids.append(int(line.split()[1]))
    p.kill()  # SIGKILL: the parent cannot pass anything on
    p.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(ended(pid) for pid in pids):
        time.sleep(0.05)
    assert all(ended(pid) for pid in pids)


# ---------------------------------------------------------------- refusals

@pytest.mark.parametrize("backend", ["reference", "mlx"])
def test_gpus_on_a_one_device_backend_is_refused_in_one_line(tmp_path, capsys, backend):
    rc = main(["train", "--preset", "test", "--backend", backend, "--gpus", "2",
               "--run-dir", str(tmp_path / "r"), "--no-sample"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert f"--gpus 2: backend {backend} has one device" in err[0]
    assert not (tmp_path / "r").exists()


def test_gpus_must_be_a_positive_count_and_match_the_launcher(tmp_path, capsys, monkeypatch):
    rc = main(["train", "--preset", "test", "--gpus", "0", "--run-dir", str(tmp_path / "r")])
    assert rc == 2 and "--gpus=0: must be a positive integer" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    rc = main(["train", "--preset", "test", "--gpus", "3", "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert rc == 2 and "--gpus 3: the launcher (torchrun) started 2 ranks" in err


def test_two_processes_under_torchruns_variables_refuse_together(tmp_path):
    """Real processes, as a launcher starts them: rank 0's refusal (the
    reference has one device) reaches rank 1 through the rendezvous; both
    exit 2, one line in all."""
    port = ranks.free_port()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    procs = []
    for r in range(2):
        e = dict(env, PYTHONPATH=ROOT, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "coppelius", "train", "--preset", "test", "--backend",
             "reference", "--run-dir", str(tmp_path / "r"), "--no-sample"], env=e, cwd=ROOT,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [2, 2]
    lines = [line for out, err in outs for line in (out + err).splitlines() if line.strip()]
    assert len(lines) == 1 and "--gpus 2: backend reference has one device" in lines[0], lines
    assert not (tmp_path / "r").exists()
