"""`coppelius export` / `coppelius import`: checkpoints to and from
safetensors, through the binding layer."""

import json
import os
import struct

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from coppelius.reference import fsutil as fsutil
from coppelius.cli import main
from coppelius.reference import State, forward, initialize, preset, registry
from coppelius.reference.binding import load_state
from coppelius.reference.checkpoint import IDENTITY_KEYS, identities, write_checkpoint
from coppelius.reference.config import Hyper, data_identity, initialization_identity

CONFIG = preset("test")
REG = registry(CONFIG)
IDS = identities(CONFIG, Hyper(lr="1/1000"), "fp32", 2, "c" * 64, "d" * 64)


def random_state(seed=0):
    """Initialized parameters with the norms perturbed (so biases matter), random moments."""
    rng = np.random.default_rng(seed)
    P = initialize(CONFIG)
    for spec in REG.specs:
        if spec.init != "normal":
            P[spec.slice] += rng.normal(0, 0.1, spec.size).astype(np.float32)
    M = rng.standard_normal(P.shape).astype(np.float32)
    V = rng.random(P.shape).astype(np.float32)
    return State(P, M, V, t=7)


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "run.ckpt"
    state = random_state()
    write_checkpoint(path, CONFIG, IDS, state, contexts=14)
    return path, state


def run_cli(capsys, *argv):
    """(exit status, stdout, stderr) of `coppelius argv...`."""
    status = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def assert_one_line_error(status, err, command, *words):
    assert status == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"coppelius {command}: error: "), err
    for word in words:
        assert word in lines[0], (word, lines[0])


# ------------------------------------------------------------------ export

def test_export_writes_spec_names_float32_and_metadata(ckpt, tmp_path, capsys):
    path, state = ckpt
    out = tmp_path / "model.safetensors"
    status, _, _ = run_cli(capsys, "export", path, out)
    assert status == 0
    tensors = load_file(str(out))
    assert set(tensors) == set(REG.by_name)  # no lm_head.weight: it is tied
    for spec in REG.specs:
        a = tensors[spec.name]
        assert a.dtype == np.float32 and a.shape == spec.shape, spec.name
        assert a.tobytes() == state.P[spec.slice].tobytes(), spec.name
    with safe_open(str(out), framework="numpy") as f:
        meta = f.metadata()
    expect = {key: str(IDS[key]) for key in IDENTITY_KEYS}
    expect.update(step="7", contexts="14")
    assert meta == expect


def test_export_with_moments(ckpt, tmp_path, capsys):
    path, state = ckpt
    out = tmp_path / "full.safetensors"
    assert run_cli(capsys, "export", path, out, "--moments")[0] == 0
    tensors = load_file(str(out))
    assert len(tensors) == 3 * len(REG.specs)
    for spec in REG.specs:
        assert np.array_equal(tensors["m/" + spec.name], state.M[spec.slice].reshape(spec.shape))
        assert np.array_equal(tensors["v/" + spec.name], state.V[spec.slice].reshape(spec.shape))


def test_export_refuses_an_existing_file_unless_force(ckpt, tmp_path, capsys):
    path, _ = ckpt
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"keep me")
    status, _, err = run_cli(capsys, "export", path, out)
    assert_one_line_error(status, err, "export", str(out), "--force")
    assert out.read_bytes() == b"keep me"
    assert run_cli(capsys, "export", path, out, "--force")[0] == 0
    assert len(load_file(str(out))) == len(REG.specs)


def test_export_refuses_a_corrupt_checkpoint(ckpt, tmp_path, capsys):
    path, _ = ckpt
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0xFF  # inside the payload's V
    path.write_bytes(bytes(raw))
    out = tmp_path / "model.safetensors"
    status, _, err = run_cli(capsys, "export", path, out)
    assert_one_line_error(status, err, "export", "SHA-256")
    assert not out.exists()


def test_export_publication_is_atomic(ckpt, tmp_path, capsys, monkeypatch):
    path, _ = ckpt
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"old")

    def disk_full(phase):
        if phase == "written":
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(fsutil, "_hook", disk_full)
    status, _, err = run_cli(capsys, "export", path, out, "--force")
    assert_one_line_error(status, err, "export", "No space left")
    assert out.read_bytes() == b"old"
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors", "run.ckpt"]  # no temporary left


# ------------------------------------------------------------------ round trip

def test_round_trip_keeps_parameter_bytes_and_identities(ckpt, tmp_path, capsys):
    path, state = ckpt
    out, back = tmp_path / "model.safetensors", tmp_path / "back.ckpt"
    assert run_cli(capsys, "export", path, out, "--moments")[0] == 0
    status, stdout, _ = run_cli(capsys, "import", out, back)
    assert status == 0 and "moment tensors not imported" in stdout
    got = load_state(back, CONFIG, expect=IDS)  # every identity carried over
    assert got.state.P.tobytes() == state.P.tobytes()
    assert not got.state.M.any() and not got.state.V.any()  # fresh moments
    assert (got.step, got.contexts) == (0, 0)
    # and the run that wrote the original accepts it through the binding layer
    again = load_state(back, CONFIG, expect=IDS)
    assert again.state.P.tobytes() == state.P.tobytes()


@pytest.mark.parametrize("fmt", [[], ["--format", "hf", "--no-tokenizer"]])
def test_round_trip_keeps_schedule_clipping_and_held_out_contexts(tmp_path, capsys, fmt):
    # what `coppelius train` writes with --schedule cosine, --clip and held-out contexts
    hyper = Hyper(lr="1/1000", schedule="cosine", warmup=10, total=100, floor="1/10", clip="1")
    ids = identities(CONFIG, hyper, "bf16", 2, "c" * 64, "d" * 64, heldout=12)
    assert "|schedule=cosine(" in ids["learner"] and ids["data"].endswith("|heldout=12")
    path, out, back = tmp_path / "run.ckpt", tmp_path / "exported", tmp_path / "back.ckpt"
    state = random_state()
    write_checkpoint(path, CONFIG, ids, state, contexts=14)
    assert run_cli(capsys, "export", path, out, *fmt)[0] == 0
    assert run_cli(capsys, "import", out, back)[0] == 0
    got = load_state(back, CONFIG, expect=ids)
    assert got.state.P.tobytes() == state.P.tobytes()


def test_import_precision_replaces_only_the_precision(ckpt, tmp_path, capsys):
    path, _ = ckpt
    out, back = tmp_path / "model.safetensors", tmp_path / "back.ckpt"
    run_cli(capsys, "export", path, out)
    assert run_cli(capsys, "import", out, back, "--precision", "bf16")[0] == 0
    header = load_state(back, CONFIG).header
    assert header["learner"] == Hyper(lr="1/1000").identity("bf16")
    assert header["data"] == IDS["data"]


# ------------------------------------------------------------------ import

def named(state):
    return {s.name: state.P[s.slice].reshape(s.shape).copy() for s in REG.specs}


def test_import_without_metadata_uses_the_documented_defaults(tmp_path, capsys):
    state = random_state(1)
    src, dst = tmp_path / "foreign.safetensors", tmp_path / "c.ckpt"
    save_file(named(state), str(src))
    status, _, err = run_cli(capsys, "import", src, dst)
    assert_one_line_error(status, err, "import", "--preset")
    assert not dst.exists()
    assert run_cli(capsys, "import", src, dst, "--preset", "test")[0] == 0
    got = load_state(dst, CONFIG)
    assert got.state.P.tobytes() == state.P.tobytes()
    assert got.header["learner"] == Hyper().identity("fp32")
    assert got.header["data"] == data_identity(CONFIG, 1, None, "none")
    assert got.header["data"].endswith("|tokenizer=none|stream=none")
    assert got.header["initialization"] == initialization_identity()
    assert run_cli(capsys, "import", src, dst, "--preset", "test", "--force", "--batch", "4",
                   "--tokenizer-sha", "e" * 64)[0] == 0
    assert load_state(dst, CONFIG).header["data"] == data_identity(CONFIG, 4, "e" * 64, "none")


def test_import_refuses_an_existing_checkpoint_unless_force(ckpt, tmp_path, capsys):
    path, state = ckpt
    src = tmp_path / "foreign.safetensors"
    save_file(named(random_state(2)), str(src))
    before = path.read_bytes()
    status, _, err = run_cli(capsys, "import", src, path, "--preset", "test")
    assert_one_line_error(status, err, "import", str(path), "--force")
    assert path.read_bytes() == before
    assert run_cli(capsys, "import", src, path, "--preset", "test", "--force")[0] == 0
    assert load_state(path, CONFIG).state.P.tobytes() == random_state(2).P.tobytes()


def test_import_tied_head_equal_is_accepted_and_different_refused(tmp_path, capsys):
    tensors = named(random_state(3))
    src, dst = tmp_path / "with_head.safetensors", tmp_path / "c.ckpt"
    tensors["lm_head.weight"] = tensors["tok_embedding.weight"].copy()
    save_file(tensors, str(src))
    assert run_cli(capsys, "import", src, dst, "--preset", "test")[0] == 0
    assert load_state(dst, CONFIG).state.P.tobytes() == random_state(3).P.tobytes()

    tensors["lm_head.weight"][5, 7] = np.nextafter(tensors["lm_head.weight"][5, 7], np.float32(1))
    save_file(tensors, str(src))
    before = dst.read_bytes()
    status, _, err = run_cli(capsys, "import", src, dst, "--preset", "test", "--force")
    assert_one_line_error(status, err, "import", "lm_head.weight", "tok_embedding.weight")
    assert dst.read_bytes() == before


def test_import_widens_bfloat16_exactly(tmp_path, capsys):
    bf16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in named(random_state(4)).items()}
    src, dst = tmp_path / "bf16.safetensors", tmp_path / "c.ckpt"
    save_file(bf16, str(src))
    assert run_cli(capsys, "import", src, dst, "--preset", "test")[0] == 0
    P = load_state(dst, CONFIG).state.P
    for spec in REG.specs:
        assert np.array_equal(P[spec.slice], bf16[spec.name].astype(np.float64).reshape(-1))


@pytest.mark.parametrize("change, words", [
    (lambda t: t.pop("layers.1.mlp.gate.weight"), ["layers.1.mlp.gate.weight", "missing tensor"]),
    (lambda t: t.update({"layers.1.mlp.gate.weight": np.zeros((96, 33), np.float32)}),
     ["layers.1.mlp.gate.weight", "bytes"]),
    (lambda t: t.update({"layers.0.attn.o.weight": np.zeros((16, 64), np.float32)}),
     ["layers.0.attn.o.weight", "shape"]),
    (lambda t: t.update({"layers.2.attn.q.weight": np.zeros((32, 32), np.float32)}),
     ["layers.2.attn.q.weight", "no parameter takes them"]),
    (lambda t: t.update({"m/layers.2.attn.q.weight": np.zeros((32, 32), np.float32)}),
     ["m/layers.2.attn.q.weight", "no parameter takes them"]),
    (lambda t: t.update({"lm_head.weight": t["tok_embedding.weight"][:, :16].copy()}),
     ["lm_head.weight", "tied"]),
])
def test_import_refuses_names_and_shapes_not_of_the_model(tmp_path, capsys, change, words):
    tensors = named(random_state(5))
    change(tensors)
    src, dst = tmp_path / "bad.safetensors", tmp_path / "c.ckpt"
    save_file(tensors, str(src))
    status, _, err = run_cli(capsys, "import", src, dst, "--preset", "test")
    assert_one_line_error(status, err, "import", *words)
    assert not dst.exists()


def test_import_refuses_metadata_of_another_model(ckpt, tmp_path, capsys):
    path, _ = ckpt
    out, dst = tmp_path / "model.safetensors", tmp_path / "c.ckpt"
    run_cli(capsys, "export", path, out)
    status, _, err = run_cli(capsys, "import", out, dst, "--preset", "tiny")
    assert_one_line_error(status, err, "import", "tiny", "vocab=64")
    assert not dst.exists()


@pytest.mark.parametrize("key, value", [
    ("learner", "objective=next-token-cross-entropy|precision=fp64|lr=1"),
    ("data", data_identity(preset("tiny"), 1, None, "none")),
    ("model", "vocab=64|context=16"),
    ("schema", "coppelius-raw-pmv-f32-v1|parameter-order:p-then-m-then-v|payload=12"),
])
def test_import_refuses_metadata_identities_it_does_not_write(tmp_path, capsys, key, value):
    src, dst = tmp_path / "meta.safetensors", tmp_path / "c.ckpt"
    save_file(named(random_state(6)), str(src), metadata={key: value})
    status, _, err = run_cli(capsys, "import", src, dst, "--preset", "test")
    assert_one_line_error(status, err, "import", key)
    assert not dst.exists()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_import_refuses_non_finite_values(ckpt, tmp_path, capsys, bad, dtype):
    path, _ = ckpt
    tensors = {k: v.astype(dtype) for k, v in named(random_state(7)).items()}
    tensors["layers.1.mlp.down.weight"][5, 17] = bad
    tensors["layers.1.mlp.down.weight"][9, 2] = bad  # a later one: the first is named
    src = tmp_path / "bad.safetensors"
    save_file(tensors, str(src))
    before = path.read_bytes()
    status, _, err = run_cli(capsys, "import", src, path, "--preset", "test", "--force")
    assert_one_line_error(status, err, "import", "bad.safetensors", "layers.1.mlp.down.weight",
                          "non-finite", "[5, 17]")
    assert path.read_bytes() == before  # nothing written over the existing checkpoint
    assert sorted(os.listdir(tmp_path)) == ["bad.safetensors", "run.ckpt"]


def test_import_refuses_a_non_finite_tied_head_with_its_owner(tmp_path, capsys):
    tensors = named(random_state(8))
    tensors["tok_embedding.weight"][0, 3] = np.nan
    tensors["lm_head.weight"] = tensors["tok_embedding.weight"].copy()  # tied: the same bits
    src, dst = tmp_path / "nan.safetensors", tmp_path / "c.ckpt"
    save_file(tensors, str(src))
    status, _, err = run_cli(capsys, "import", src, dst, "--preset", "test")
    assert_one_line_error(status, err, "import", "tok_embedding.weight", "[0, 3]")
    assert not dst.exists()


@pytest.mark.parametrize("seed", [-5, -1, 2**64, 2**70])
def test_import_refuses_a_seed_outside_uint64(tmp_path, capsys, seed):
    src, dst = tmp_path / "seed.safetensors", tmp_path / "c.ckpt"
    save_file(named(random_state(9)), str(src),
              metadata={"initialization": initialization_identity(seed)})
    status, _, err = run_cli(capsys, "import", src, dst, "--preset", "test")
    assert_one_line_error(status, err, "import", "seed.safetensors", "initialization",
                          f"seed {seed} ")
    assert not dst.exists()


@pytest.mark.parametrize("seed", [0, 2**64 - 1])
def test_import_accepts_every_uint64_seed(tmp_path, capsys, seed):
    src, dst = tmp_path / "seed.safetensors", tmp_path / "c.ckpt"
    save_file(named(random_state(9)), str(src),
              metadata={"initialization": initialization_identity(seed)})
    assert run_cli(capsys, "import", src, dst, "--preset", "test")[0] == 0
    assert load_state(dst, CONFIG).header["initialization"] == initialization_identity(seed)


def test_import_refuses_a_lying_file(tmp_path, capsys):
    header = json.dumps({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                         "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}).encode()
    src, dst = tmp_path / "lie.safetensors", tmp_path / "c.ckpt"
    src.write_bytes(struct.pack("<Q", len(header)) + header + bytes(24))
    status, _, err = run_cli(capsys, "import", src, dst, "--preset", "test")
    assert_one_line_error(status, err, "import", "lie.safetensors", "overlap")
    assert not dst.exists()


# ------------------------------------------------------------------ PyTorch

def test_exported_tensors_load_into_a_plain_pytorch_model(ckpt, tmp_path, capsys):
    torch = pytest.importorskip("torch")
    nn, F = torch.nn, torch.nn.functional
    path, state = ckpt
    out = tmp_path / "model.safetensors"
    assert run_cli(capsys, "export", path, out)[0] == 0
    c = CONFIG
    E = c.head_dim

    def rope(x):  # (B,H,T,E), half-split pairs: j with j + E/2
        T = x.shape[2]
        j = torch.arange(E // 2, dtype=torch.float64)
        theta = torch.arange(T, dtype=torch.float64)[:, None] * 10000.0 ** (-2 * j / E)
        cos, sin = torch.cos(theta).float(), torch.sin(theta).float()  # (T, E/2)
        a, b = x[..., :E // 2], x[..., E // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(c.d_model, c.d_model, bias=False)
                                              for _ in range(4))

        def forward(self, h):  # (B,T,D)
            B, T, D = h.shape
            q, k, v = (m(h).view(B, T, c.n_head, E).transpose(1, 2) for m in (self.q, self.k, self.v))
            y = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)  # (B,H,T,E)
            return self.o(y.transpose(1, 2).reshape(B, T, D))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(c.d_model, c.d_ff, bias=False)
            self.up = nn.Linear(c.d_model, c.d_ff, bias=False)
            self.down = nn.Linear(c.d_ff, c.d_model, bias=False)

        def forward(self, h):
            return self.down(F.silu(self.gate(h)) * self.up(h))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn_norm = nn.LayerNorm(c.d_model, eps=1e-5)
            self.attn = Attention()
            self.mlp_norm = nn.LayerNorm(c.d_model, eps=1e-5)
            self.mlp = MLP()

        def forward(self, x):
            x = x + self.attn(self.attn_norm(x))
            return x + self.mlp(self.mlp_norm(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_embedding = nn.Embedding(c.vocab, c.d_model)
            self.layers = nn.ModuleList(Block() for _ in range(c.n_layer))
            self.final_norm = nn.LayerNorm(c.d_model, eps=1e-5)
            self.lm_head = nn.Linear(c.d_model, c.vocab, bias=False)
            self.lm_head.weight = self.tok_embedding.weight  # tied

        def forward(self, tokens):
            x = self.tok_embedding(tokens)
            for block in self.layers:
                x = block(x)
            return self.lm_head(self.final_norm(x))

    model = GPT()
    tensors = {k: torch.from_numpy(v.copy()) for k, v in load_file(str(out)).items()}
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert missing == ["lm_head.weight"] and unexpected == []  # the names are the SPEC's
    tokens = np.random.default_rng(8).integers(0, c.vocab, (2, c.context))
    with torch.no_grad():
        got = model(torch.from_numpy(tokens)).numpy()
    want = forward(c, state.P, tokens)
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < 1e-5, err
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
