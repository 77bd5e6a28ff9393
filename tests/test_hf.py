"""The Hugging Face directory loaded by transformers with no custom code
(SPEC 20): AutoModelForCausalLM's logits against the reference forward,
AutoTokenizer against the project's tokenizer, generate, and a directory
transformers itself saved, imported back. Needs transformers and torch
(`tox -e hf`); skipped where they are not installed."""

import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local directories only: never the network
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.test_hf_directory import make_run, stdlib_text  # noqa: E402

from coppelius.cli import main  # noqa: E402
from coppelius.tokenizer import encode, load_tokenizer  # noqa: E402
from coppelius.reference import forward, preset, round_bf16  # noqa: E402
from coppelius.reference.binding import load_state  # noqa: E402
from coppelius.sample import generate  # noqa: E402

pytestmark = pytest.mark.hf

# Tolerances on the relative error ||got - want|| / ||want|| of a whole
# (B, T, V) logits tensor. float32: 1e-5, the bound the export promises;
# measured 5e-7 (`test`) and 1.2e-6 (`tiny`): torch's and NumPy's sums, and
# the rotary tables (transformers computes the angles in float32, the
# reference in float64), differ in the last bits. bfloat16 weights run in
# bfloat16: every activation is rounded to 8 significant bits too; measured
# 1e-2 on both presets. Two tensors of one layer swapped (q with k, gate
# with up, the two norm biases) give 0.4 to 0.9 with these parameters.
FP32 = 1e-5
BF16_NATIVE = 5e-2

# Text that no tokenizer here was trained on, with what a byte-level BPE must
# get right: non-ASCII letters, emoji (4-byte UTF-8), combining marks, CRLF,
# tabs, runs of spaces and blank lines.
AWKWARD = ("naïve café — Ωμέγα 日本語 🐍🧪 e\u0301\r\n\tindented\n\n\n"
           "    four spaces  two  \x00 ends\n")


def relative_error(got, want) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def logits_of(model, contexts) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(contexts)).logits.float().numpy()


@pytest.fixture(scope="module")
def corpus():
    return stdlib_text("html", "http") + AWKWARD


@pytest.fixture(scope="module")
def exported(tmp_path_factory, corpus):
    """{preset: (checkpoint, state, directory, contexts)}: a run with
    trained-like parameters exported as float32 and as bfloat16, and four
    contexts of T ids cut from the corpus as the run's tokenizer encodes it
    (the test preset's V = 64 has no byte-level BPE: its contexts are those
    ids modulo 64, and it is exported without a tokenizer)."""
    root = tmp_path_factory.mktemp("hf")
    text = stdlib_text("json", "email")
    out = {}
    for name in ("tiny", "test"):  # tiny first: its tokenizer cuts the contexts of both
        config = preset(name)
        run = root / name
        checkpoint, state, _ = make_run(run, config, text if name == "tiny" else None, seed=3)
        extra = [] if name == "tiny" else ["--no-tokenizer"]
        for dtype in ("float32", "bfloat16"):
            assert main(["export", str(checkpoint), str(run / dtype), "--format", "hf",
                         "--dtype", dtype] + extra) == 0
        if name == "tiny":
            ids = encode(load_tokenizer(run / "tokenizer.json"), corpus).astype(np.int64)
        starts = np.linspace(0, ids.size - config.context - 1, 4).astype(int)
        contexts = np.stack([ids[s:s + config.context] % config.vocab for s in starts])  # (4, T)
        out[name] = (checkpoint, state, run, contexts)
    return out


@pytest.mark.parametrize("name", ["test", "tiny"])
def test_logits_equal_the_reference_forward(exported, name):
    _, state, run, contexts = exported[name]
    config = preset(name)
    model = transformers.AutoModelForCausalLM.from_pretrained(run / "float32")
    assert type(model).__name__ == "StableLmForCausalLM" and model.dtype == torch.float32
    want = forward(config, state.P, contexts, "fp32")  # (4, T, V)
    got = logits_of(model, contexts)
    err = relative_error(got, want)
    print(f"{name}: float32 logits relative error {err:.3g}, max |diff| "
          f"{np.abs(got - want).max():.3g} of max |logit| {np.abs(want).max():.3g}")
    assert err < FP32, err
    # a prefix is the same model: positions are absolute from 0
    short = contexts[:, :7]
    assert relative_error(logits_of(model, short), forward(config, state.P, short, "fp32")) < FP32


@pytest.mark.parametrize("name", ["test", "tiny"])
def test_bfloat16_export_is_the_rounded_model(exported, name):
    _, state, run, contexts = exported[name]
    config = preset(name)
    want = forward(config, round_bf16(state.P), contexts, "fp32")
    # widened to float32 on load, the weights are round_bf16(P) exactly
    wide = transformers.AutoModelForCausalLM.from_pretrained(run / "bfloat16", dtype=torch.float32)
    err = relative_error(logits_of(wide, contexts), want)
    assert err < FP32, err
    # as config.json says, a bfloat16 model
    native = transformers.AutoModelForCausalLM.from_pretrained(run / "bfloat16", dtype="auto")
    assert native.dtype == torch.bfloat16
    err_native = relative_error(logits_of(native, contexts), want)
    print(f"{name}: bfloat16 export, float32 compute {err:.3g}, bfloat16 compute {err_native:.3g}")
    assert err_native < BF16_NATIVE, err_native


def test_tokenizer_encodes_as_the_project_does(exported, corpus):
    run = exported["tiny"][2]
    project = load_tokenizer(run / "tokenizer.json")
    tok = transformers.AutoTokenizer.from_pretrained(run / "float32")
    assert isinstance(tok, transformers.PreTrainedTokenizerFast)
    assert len(tok) == preset("tiny").vocab
    ids = tok(corpus)["input_ids"]
    assert ids == encode(project, corpus).tolist()  # the whole corpus, id for id
    assert tok.decode(ids) == corpus
    for text in [AWKWARD, "def f(x):\n    return x , y .", " leading space", "", "\n"]:
        encoded = tok(text)["input_ids"]  # no special tokens: the vocabulary has none
        assert encoded == project.encode(text, add_special_tokens=False).ids, text
        assert tok.decode(encoded) == text, text


def test_generate_runs_and_greedy_is_coppelius_sample(exported):
    checkpoint, state, run, contexts = exported["tiny"]
    config = preset("tiny")
    model = transformers.AutoModelForCausalLM.from_pretrained(run / "float32")
    tok = transformers.AutoTokenizer.from_pretrained(run / "float32")
    prompt = tok("def", return_tensors="pt").input_ids
    torch.manual_seed(0)
    sampled = model.generate(prompt, max_new_tokens=12)  # generation_config: sampling
    assert sampled.shape == (1, prompt.shape[1] + 12)  # no EOS: runs the whole length
    assert isinstance(tok.decode(sampled[0]), str)
    start = contexts[:1, :20]
    greedy = model.generate(torch.from_numpy(start), max_new_tokens=16, do_sample=False)
    want = generate(config, state.P, start[0].tolist(), 16, temperature=0.0)
    assert greedy[0].tolist() == want


def test_a_directory_transformers_saved_imports_back(exported, tmp_path, capsys):
    _, state, run, _ = exported["tiny"]
    model = transformers.AutoModelForCausalLM.from_pretrained(run / "float32")
    tok = transformers.AutoTokenizer.from_pretrained(run / "float32")
    saved = tmp_path / "saved"
    model.save_pretrained(saved)
    tok.save_pretrained(saved)
    back = tmp_path / "back.ckpt"
    assert main(["import", str(saved), str(back)]) == 0, capsys.readouterr().err
    assert load_state(back, preset("tiny")).state.P.tobytes() == state.P.tobytes()
    assert main(["inspect", str(saved)]) == 0


# ------------------------------------------------------------------ transformers' own models
# For each architecture of SPEC 21, a model made by transformers from a small
# random configuration (grouped-query attention, an untied head, partial
# rotary and q, k, v biases where the architecture has them), saved with
# save_pretrained and imported: the import is exact (the tensors, by name),
# its forward is transformers' (fp32, SPEC 14's 1e-5), one reference step
# (reference.step) is one torch.optim.AdamW step of transformers' model with
# SPEC 7's hyperparameters (SPEC 14's fp32 tolerances), and the export loads
# back into transformers with equal tensors.

from coppelius.hf import hf_names  # noqa: E402
from coppelius.reference import Hyper, State, step  # noqa: E402
from coppelius.reference.checkpoint import validate  # noqa: E402
from coppelius.reference.config import config_from_identity  # noqa: E402
from coppelius.reference.params import registry  # noqa: E402

SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
# architecture -> (config class, model class, fields beyond SHAPE, the SPEC 21 fields it is)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False),
              dict(norm="rmsnorm", n_kv_head=2, tied=False, qkv_bias=False, rotary=1)),
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True),
                   dict(norm="rmsnorm", n_kv_head=2, tied=True, qkv_bias=False, rotary=1)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False),
              dict(norm="rmsnorm", n_kv_head=2, tied=False, qkv_bias=True, rotary=1)),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM",
                 dict(partial_rotary_factor=0.5, use_qkv_bias=True, tie_word_embeddings=False),
                 dict(norm="layernorm", n_kv_head=2, tied=False, qkv_bias=True, rotary=0.5)),
}
# One AdamW step, fp32 (SPEC 14): the gradient 1e-4, P, M, V after the update
# 1e-5 (measured: G and M 2.5e-6, V 3.6e-6, P 5e-8). The update P' - P is
# compared on its own too: on P' alone, weight decay put on the norms and
# biases, or taken off the matrices, would hide inside 1e-5 of |P| (the decay
# is lr * weight_decay * p = 3e-5 p), while on the update, about lr = 3e-4
# per element, it shows as 1e-2 or more. The update's own error is float32's
# rounding of P' (an ulp of |P| ~ 0.3 is 3e-8, 1e-4 of the update; torch
# also decays as p * (1 - lr wd), SPEC 7 as p - (lr wd) p): measured 4.3e-5,
# so 3e-4.
STEP_TOLERANCE = {"G": 1e-4, "P": 1e-5, "M": 1e-5, "V": 1e-5, "update": 3e-4}


def zero_in_exact_arithmetic(config, spec) -> np.ndarray:
    """(size,) bool: the elements of parameter `spec` whose gradient is zero
    in exact arithmetic, so that each side's is rounding noise: with partial
    rotary, the key bias past the R rotated elements of each head adds q . b,
    the same to every key of a query's row, which the softmax takes away.
    AdamW turns noise g into lr * g / (|g| + epsilon), anything up to lr:
    those elements are held to |update| <= lr rather than compared."""
    if not spec.name.endswith("attn.k.bias"):
        return np.zeros(spec.size, dtype=bool)
    mask = np.zeros((config.kv_heads, config.head_dim), dtype=bool)  # (Hkv, E)
    mask[:, config.rotary_dim:] = True
    return mask.reshape(-1)


def transformers_model(family: str, seed: int = 0, **overrides):
    config_class, model_class, fields, _ = FAMILIES[family]
    config = getattr(transformers, config_class)(**{**SHAPE, **fields, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():  # values that look trained: norms and biases away from 1 and 0
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() == 1 else 1 / p.shape[-1] ** 0.5)
                    + (1.0 if name.endswith("norm.weight") else 0.0))
    return model


def imported(model, directory, capsys, **save):
    """save_pretrained(directory), `coppelius import` -> (config, P, header)."""
    model.save_pretrained(directory, **save)
    capsys.readouterr()  # transformers' own progress lines
    ck = directory / "imported.ckpt"
    assert main(["import", str(directory), str(ck)]) == 0, capsys.readouterr().err
    header = validate(ck).header
    config = config_from_identity(header["model"])
    return config, load_state(ck, config).state, header


def tensors_by_hf_name(config, P) -> dict:
    """{transformers name: (shape) float32} of the flat vector P (no tied alias)."""
    reg = registry(config)
    names = hf_names(config)
    return {names[s.name]: P[s.slice].reshape(s.shape) for s in reg.specs}


@pytest.fixture(params=sorted(FAMILIES))
def family(request):
    return request.param


def test_an_imported_model_is_the_transformers_model(family, tmp_path, capsys):
    model = transformers_model(family)
    config, state, header = imported(model, tmp_path / "saved", capsys)
    want = FAMILIES[family][3]
    got = {"norm": config.norm, "n_kv_head": config.kv_heads, "tied": config.tied,
           "qkv_bias": config.qkv_bias, "rotary": float(config.rotary)}
    assert got == want
    assert (header["step"], header["contexts"]) == (0, 0)
    assert not state.M.any() and not state.V.any() and state.t == 0
    # every tensor, by name, exactly
    theirs = {k: v.numpy() for k, v in model.state_dict().items()}
    ours = tensors_by_hf_name(config, state.P)
    if config.tied:
        assert "lm_head.weight" not in ours
        theirs.pop("lm_head.weight")  # the same storage as model.embed_tokens.weight
    assert sorted(ours) == sorted(theirs)
    for name in ours:
        assert ours[name].tobytes() == theirs[name].tobytes(), name
    # the forward, on random ids
    ids = np.random.default_rng(1).integers(0, config.vocab, (3, config.context))
    err = relative_error(forward(config, state.P, ids, "fp32"), logits_of(model, ids))
    print(f"{family}: fp32 logits relative error {err:.3g}")
    assert err < FP32, err


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_half_precision_directory_widens_exactly(dtype, tmp_path, capsys):
    model = transformers_model("qwen2").to(getattr(torch, dtype))
    config, state, _ = imported(model, tmp_path / "saved", capsys)
    ours = tensors_by_hf_name(config, state.P)
    for name, tensor in model.state_dict().items():
        assert ours[name].tobytes() == tensor.float().numpy().tobytes(), name


def test_a_sharded_directory_imports_as_one_file_does(family, tmp_path, capsys):
    model = transformers_model(family)
    whole = imported(model, tmp_path / "whole", capsys)[1].P
    config, state, _ = imported(model, tmp_path / "shards", capsys, max_shard_size="20KB")
    shards = sorted(p.name for p in (tmp_path / "shards").glob("model-*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "shards" / "model.safetensors.index.json").exists()
    assert state.P.tobytes() == whole.tobytes()


def torch_adamw_step(model, tokens, hyper):
    """One torch.optim.AdamW step of transformers' model on tokens (B, T+1)
    with SPEC 7's hyperparameters: weight decay on the two-dimensional
    parameters only (the decay mask), bias correction as SPEC 7 writes it
    (torch's own). Returns (loss, {name: (gradient, parameter after,
    exp_avg, exp_avg_sq)})."""
    params = dict(model.named_parameters())  # a tied head appears once, as the embedding
    groups = [{"params": [p for p in params.values() if p.dim() == 2],
               "weight_decay": float(hyper.weight_decay)},
              {"params": [p for p in params.values() if p.dim() != 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=float(hyper.lr), betas=(float(hyper.beta1),
                            float(hyper.beta2)), eps=float(hyper.epsilon), foreach=False)
    model.train()  # dropout is 0: the forward is the same
    ids = torch.from_numpy(tokens)
    logits = model(ids[:, :-1]).logits  # (B, T, V)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             ids[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    grads = {name: p.grad.detach().clone().numpy() for name, p in params.items()}
    opt.step()
    out = {name: (grads[name], p.detach().numpy(), opt.state[p]["exp_avg"].numpy(),
                  opt.state[p]["exp_avg_sq"].numpy()) for name, p in params.items()}
    return loss.item(), out


def test_one_reference_step_is_one_torch_adamw_step(family, tmp_path, capsys):
    model = transformers_model(family, seed=2)
    config, state, _ = imported(model, tmp_path / "saved", capsys)
    hyper = Hyper()  # SPEC 7's defaults: lr 3/10000, betas 9/10 and 95/100, decay 1/10
    tokens = np.random.default_rng(3).integers(0, config.vocab, (2, config.context + 1))
    result = step(config, state, tokens, "fp32", hyper, grads=True)
    loss, theirs = torch_adamw_step(model, tokens, hyper)
    assert abs(float(result.loss) - loss) / abs(loss) < FP32, (result.loss, loss)
    reg = registry(config)
    names = hf_names(config)
    worst = {}
    for spec in reg.specs:
        grad, after, m, v = theirs[names[spec.name]]
        ours = {"G": result.grads[spec.slice], "P": result.state.P[spec.slice],
                "M": result.state.M[spec.slice], "V": result.state.V[spec.slice],
                "update": result.state.P[spec.slice] - state.P[spec.slice]}
        want = {"G": grad, "P": after, "M": m, "V": v,
                "update": after.reshape(-1) - state.P[spec.slice]}
        noise = zero_in_exact_arithmetic(config, spec)
        for what, tolerance in STEP_TOLERANCE.items():
            keep = ~noise if what in ("P", "update") else slice(None)
            err = relative_error(ours[what][keep], want[what].reshape(-1)[keep])
            worst[what] = max(worst.get(what, 0.0), err)
            assert err < tolerance, (spec.name, what, err)
        if noise.any():
            scale = np.abs(ours["G"][~noise]).max()
            assert np.abs(ours["G"][noise]).max() < 1e-5 * scale, spec.name
            assert np.abs(grad.reshape(-1)[noise]).max() < 1e-5 * scale, spec.name
            bound = float(hyper.lr) * 1.001
            assert np.abs(ours["update"][noise]).max() <= bound, spec.name
            assert np.abs(want["update"][noise]).max() <= bound, spec.name
    print(f"{family}: worst relative errors {worst}")


def test_an_export_loads_back_into_transformers_with_equal_tensors(family, tmp_path, capsys):
    model = transformers_model(family, seed=4)
    _, _, _ = imported(model, tmp_path / "saved", capsys)
    out = tmp_path / "exported"
    assert main(["export", str(tmp_path / "saved" / "imported.ckpt"), str(out), "--format", "hf",
                 "--no-tokenizer"]) == 0, capsys.readouterr().err
    back = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(back).__name__ == FAMILIES[family][1] and back.dtype == torch.float32
    theirs, ours = model.state_dict(), back.state_dict()
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name
    ids = torch.from_numpy(np.random.default_rng(5).integers(0, 96, (2, 16)))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)


def saved_config_json(family, directory, **overrides) -> dict:
    transformers_model(family, **overrides).save_pretrained(directory)
    import json

    return json.loads((directory / "config.json").read_text())


@pytest.mark.parametrize("family, overrides, words", [
    ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), ["rope_type", "linear"]),
    ("llama", dict(head_dim=16), ["head_dim", "16", "8"]),
    ("llama", dict(attention_bias=True), ["attention_bias", "true", "Qwen2ForCausalLM"]),
    ("llama", dict(mlp_bias=True), ["mlp_bias", "true"]),
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
     ["use_sliding_window", "true"]),
    ("qwen2", dict(num_experts=4), ["num_experts", "mixture-of-experts"]),
    ("stablelm", dict(qk_layernorm=True), ["qk_layernorm", "true"]),
    ("stablelm", dict(use_parallel_residual=True), ["use_parallel_residual", "true"]),
    ("stablelm", dict(partial_rotary_factor=0.3), ["partial_rotary_factor", "0.3"]),
])
def test_import_refuses_what_transformers_saved_of_another_model(family, overrides, words,
                                                                 tmp_path, capsys):
    saved_config_json(family, tmp_path / "saved", **overrides)
    capsys.readouterr()  # transformers' own progress lines
    dst = tmp_path / "imported.ckpt"
    assert main(["import", str(tmp_path / "saved"), str(dst)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "config.json" in err, err
    for word in words:
        assert word in err, (word, err)
    assert not dst.exists()


def test_fine_tune_a_transformers_model_from_the_command_line(tmp_path, capsys, monkeypatch,
                                                              corpus):
    """import -> train (no --preset; --tokenizer the directory) -> export ->
    transformers: the model transformers loads is the fine-tuned checkpoint."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    monkeypatch.chdir(tmp_path)  # the default run directory here (the stream cache: conftest's)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([corpus], trainers.BpeTrainer(
        vocab_size=300, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    model = transformers_model("qwen2", seed=6, vocab_size=320)  # 300 ids padded to V = 320
    saved = tmp_path / "saved"
    model.save_pretrained(saved)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(saved)
    source = tmp_path / "notes.txt"
    source.write_text(corpus, encoding="utf-8")
    ck = tmp_path / "tuned.ckpt"
    for argv in (["import", saved, ck],
                 ["train", "--checkpoint", ck, "--source", source, "--tokenizer", saved,
                  "--new-data", "--steps", "3", "--backend", "reference", "--no-sample"],
                 ["export", ck, tmp_path / "out", "--format", "hf"]):
        capsys.readouterr()
        assert main([str(a) for a in argv]) == 0, capsys.readouterr().err
    header = validate(ck).header
    config = config_from_identity(header["model"])
    P = load_state(ck, config).state.P
    assert header["step"] == 3
    assert P.tobytes() != imported(model, tmp_path / "again", capsys)[1].P.tobytes()
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(back).__name__ == "Qwen2ForCausalLM"
    ids = np.random.default_rng(7).integers(0, 300, (2, config.context))
    assert relative_error(logits_of(back, ids), forward(config, P, ids, "fp32")) < FP32
    # the tokenizer as the file has it (for model_type qwen2, AutoTokenizer in
    # transformers 5 is Qwen2Tokenizer, which rebuilds the tokenizer from the
    # vocabulary with Qwen2's own pre-tokenizer; see coppelius.hf)
    loaded = transformers.PreTrainedTokenizerFast.from_pretrained(tmp_path / "out")
    assert loaded(corpus)["input_ids"] == tok.encode(corpus).ids
