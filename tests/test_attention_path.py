"""Which attention the CuPy backend's step runs (policy.attention_path)
and the one reason it gives when cuDNN's is not used: no GPU needed (the
cuDNN side is replaced by stand-ins that serve or refuse a shape)."""

import types

import pytest

from coppelius.accelerated.cuda import attention_fused, cudnn_attention, policy
from coppelius.accelerated.cuda.attention import attention_scale
from coppelius.reference.config import Config, preset

COPPELIUS = preset("coppelius")


class Served:
    """cudnn_attention.graph as where cuDNN serves every shape: records the
    shapes and directions asked for."""

    def __init__(self):
        self.asked = []

    def __call__(self, direction, B, T, H, E, scale, kv_heads=None):
        self.asked.append((direction, B, T, H, E, scale) + ((kv_heads,) if kv_heads != H else ()))
        return types.SimpleNamespace(device=0, direction=direction)


def trial(outcome):
    """A stand-in for cudnn_attention._trial: `outcome` for every shape."""
    return lambda graphs: outcome


@pytest.fixture
def served(monkeypatch):
    monkeypatch.delenv("COPPELIUS_NO_CUDNN", raising=False)
    monkeypatch.setattr(cudnn_attention, "MIN_BATCH", 2)
    monkeypatch.setattr(attention_fused, "ATTENTION_FUSED_MIN_BATCH", 4)
    monkeypatch.setattr(cudnn_attention, "_trials", {})
    monkeypatch.setattr(cudnn_attention, "_trial", trial(""))
    stand_in = Served()
    monkeypatch.setattr(cudnn_attention, "graph", stand_in)
    return stand_in


def test_cudnn_from_its_batch_on_where_it_serves_the_shape(served):
    path = policy.attention_path(COPPELIUS, "bf16", 8)
    assert path == policy.AttentionPath("cudnn", "")
    scale = attention_scale(64)
    assert served.asked == [("forward", 8, 1024, 8, 64, scale), ("backward", 8, 1024, 8, 64, scale)]
    assert policy.fused_attention(COPPELIUS, "bf16", 8)


@pytest.mark.parametrize("name", ["llama-124m", "test-llama", "test-stablelm"])
def test_grouped_heads_ask_cudnn_for_their_key_value_heads(served, name):
    """A model with grouped heads asks cuDNN for the graphs of its H query
    and Hkv key/value heads; the partial rotary changes nothing here (it is
    the rope kernels')."""
    config = preset(name)
    assert config.kv_heads < config.n_head
    assert policy.attention_path(config, "bf16", 8).kind == "cudnn"
    scale = attention_scale(config.head_dim)
    shape = (8, config.context, config.n_head, config.head_dim, scale, config.kv_heads)
    assert served.asked == [("forward", *shape), ("backward", *shape)]


def test_the_fused_kernels_serve_grouped_heads_where_cudnn_does_not(monkeypatch):
    """cuDNN refusing a grouped shape: the project's fused kernels (their
    head dims, from their batch on), which index key/value head h // g,
    with cuDNN's reason."""
    monkeypatch.delenv("COPPELIUS_NO_CUDNN", raising=False)
    monkeypatch.setattr(cudnn_attention, "MIN_BATCH", 1)
    monkeypatch.setattr(attention_fused, "ATTENTION_FUSED_MIN_BATCH", 4)
    asked = []

    def refused(direction, B, T, H, E, scale, kv_heads=None):
        asked.append(kv_heads)
        return f"cuDNN refuses the {direction} of B={B} T={T} H={H} Hkv={kv_heads} E={E} (x)"

    monkeypatch.setattr(cudnn_attention, "graph", refused)
    config = Config(vocab=8, context=64, d_model=256, n_layer=1, n_head=4, d_ff=8, n_kv_head=2)
    path = policy.attention_path(config, "bf16", 8)
    assert path == policy.AttentionPath("fused", "cuDNN refuses the forward of B=8 T=64 H=4 "
                                                 "Hkv=2 E=64 (x)")
    assert asked == [2, 2]  # the forward and the backward, each for its Hkv = 2
    assert policy.attention_path(config, "bf16", 2).kind == "materialized"


def test_a_forward_only_step_asks_for_the_forward_alone(served):
    path = policy.attention_path(COPPELIUS, "bf16", 3, context=17, train=False)
    assert path.kind == "cudnn"
    assert [a[:3] for a in served.asked] == [("forward", 3, 17)]


def test_below_cudnns_batch_the_projects_kernels_with_the_reason(served):
    path = policy.attention_path(COPPELIUS, "bf16", 1)
    assert path.kind == "materialized"  # below the fused kernels' batch too
    assert path.reason.startswith("batch 1 < 2: ")
    assert served.asked == []  # below the threshold cuDNN is not asked
    assert not policy.fused_attention(COPPELIUS, "bf16", 1)


def test_fp32_keeps_the_materialized_scores(served):
    path = policy.attention_path(COPPELIUS, "fp32", 8)
    assert path.kind == "materialized" and path.reason.startswith("fp32 policy")
    assert served.asked == []


@pytest.mark.parametrize("batch, E, kind", [(8, 64, "fused"), (8, 24, "materialized"),
                                            (2, 64, "materialized")])
def test_a_shape_cudnn_refuses_runs_the_projects_kernels_with_cudnns_reason(monkeypatch, batch,
                                                                              E, kind):
    monkeypatch.delenv("COPPELIUS_NO_CUDNN", raising=False)
    monkeypatch.setattr(cudnn_attention, "MIN_BATCH", 1)
    monkeypatch.setattr(attention_fused, "ATTENTION_FUSED_MIN_BATCH", 4)
    why = f"cuDNN refuses the backward of B={batch} T=64 H=2 E={E} (RuntimeError: no engine)"
    monkeypatch.setattr(cudnn_attention, "_trials", {})
    monkeypatch.setattr(cudnn_attention, "_trial", trial(""))
    monkeypatch.setattr(cudnn_attention, "graph",
                        lambda direction, *shape, kv_heads=None: why if direction == "backward"
                        else types.SimpleNamespace(device=0))
    config = Config(vocab=8, context=64, d_model=2 * E, n_layer=1, n_head=2, d_ff=8)
    assert policy.attention_path(config, "bf16", batch) == policy.AttentionPath(kind,
                                                                                            why)
    # a forward-only step needs no backward: cuDNN's
    assert policy.attention_path(config, "bf16", batch, train=False).kind == "cudnn"


def test_a_failed_trial_is_the_reason_and_is_remembered(served, monkeypatch):
    """A shape whose graphs build but fail their trial runs (a failed
    execution, outputs unwritten, two runs that differ) is not served; the
    trial runs once per shape."""
    why = "cuDNN's attention of B=8 T=1024 H=8 E=64 is not bitwise reproducible (dqk)"
    trials = []
    monkeypatch.setattr(cudnn_attention, "_trial", lambda graphs: trials.append(graphs) or why)
    for _ in range(2):
        assert policy.attention_path(COPPELIUS, "bf16", 8) == \
            policy.AttentionPath("fused", why)
    assert [[g.direction for g in graphs] for graphs in trials] == [["forward", "backward"]]


def test_no_frontend_is_one_reason(monkeypatch):
    monkeypatch.delenv("COPPELIUS_NO_CUDNN", raising=False)
    monkeypatch.setattr(cudnn_attention, "MIN_BATCH", 1)
    monkeypatch.setattr(cudnn_attention, "_frontend", None)
    monkeypatch.setattr(cudnn_attention, "_import_error", "ModuleNotFoundError: No module named "
                                                          "'cudnn'")
    path = policy.attention_path(COPPELIUS, "bf16", 8)
    assert path.kind == ("fused" if 8 >= attention_fused.ATTENTION_FUSED_MIN_BATCH
                         else "materialized")
    assert path.reason == ("nvidia-cudnn-frontend not importable (ModuleNotFoundError: No module "
                           "named 'cudnn')")


def test_the_switch_turns_cudnn_off(monkeypatch):
    monkeypatch.setenv("COPPELIUS_NO_CUDNN", "1")
    monkeypatch.setattr(cudnn_attention, "MIN_BATCH", 1)
    path = policy.attention_path(COPPELIUS, "bf16", 8)
    assert path.kind != "cudnn" and path.reason == "disabled by COPPELIUS_NO_CUDNN"


def test_a_failed_import_is_remembered_as_its_one_line(monkeypatch):
    """frontend() tries once; what it raised is the reason."""
    import builtins

    real = builtins.__import__

    def no_cudnn(name, *args, **kwargs):
        if name == "cudnn":
            raise ImportError("libcudnn.so.9: cannot open shared object file")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(cudnn_attention, "_frontend", None)
    monkeypatch.setattr(cudnn_attention, "_import_error", None)
    monkeypatch.setattr(builtins, "__import__", no_cudnn)
    assert cudnn_attention.frontend() is None
    assert cudnn_attention.import_error() == ("ImportError: libcudnn.so.9: cannot open shared "
                                              "object file")
    assert cudnn_attention.versions() == {}
