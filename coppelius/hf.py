"""The Hugging Face model directory (SPEC sections 20 and 21).

Every member of the model family (SPEC 21) is exactly one `transformers`
architecture, loaded with no custom code:

    norm       rotary  qkv_bias  architecture (model_type)
    layernorm  any     any       StableLmForCausalLM (stablelm)
    rmsnorm    1       false     LlamaForCausalLM (llama)
    rmsnorm    1       true      Qwen2ForCausalLM (qwen2)

An rmsnorm model with a partial rotary embedding is none of them, and is
refused by name (`rotary`). What each architecture computes, and so why it is
that member: StableLM rotates the first `partial_rotary_factor * E` elements
of each head with half-split pairs (`rotate_half` within them), LayerNorm
with a bias, optional biases on q, k and v (`use_qkv_bias`), no LayerNorm on
q and k, sequential residuals; Llama has RMSNorm (`rms_norm_eps`, the mean
of x^2 in float32), the whole head rotated, no bias anywhere
(`attention_bias`, `mlp_bias` false); Qwen2 is Llama with biases on q, k
and v (not o) and full attention in every layer. All three: SwiGLU
(`hidden_act` silu), grouped-query attention by `repeat_kv` (query head h
reads key/value head h // g), the head tied to the embedding or not
(`tie_word_embeddings`).

A model is written as a directory:

    config.json             the architecture's fields (config_json)
    model.safetensors       the parameters under transformers' names (HF_NAMES),
                            float32 or bfloat16, without a tied lm_head.weight;
                            metadata "format": "pt" (transformers loads no file
                            without it) and the checkpoint's identities, step and
                            contexts, as `coppelius export` always writes them
    tokenizer.json          the run's tokenizer, byte for byte: its SHA-256 stays
                            the one the data identity names
    tokenizer_config.json   a PreTrainedTokenizerFast over tokenizer.json
    generation_config.json  `coppelius sample`'s defaults (sampling, temperature
                            0.8, top-k 40)

Names. The three architectures name the parameters alike (hf_name): SPEC
`layers.{l}.attn_norm` is `model.layers.{l}.input_layernorm`, `mlp_norm` is
`post_attention_layernorm`, `attn.{q,k,v,o}` are `self_attn.{q,k,v,o}_proj`
(with `.bias` where qkv_bias), `mlp.{gate,up,down}` are
`mlp.{gate,up,down}_proj`, `final_norm` is `model.norm`, the embedding
`model.embed_tokens`, an untied head `lm_head.weight`. No architecture of
the three fuses or transposes a tensor, so the binding (SPEC 12,
reference.binding) reads each parameter with the recipe `Tensor(key)`, a
renaming, and `Cast(Tensor(key), "float32")` where the file holds bfloat16
or float16 (both widen to float32 exactly); import binds the parameters
under the file's own names so that a refusal names the tensor as the file
has it. Export writes the float32 values under these names (bfloat16:
rounded to nearest even first).

Reading a directory (model_of, weights_source). config.json is read key by
key: each key is a field of the model, a value the architecture must have
(`qk_layernorm` false, `use_sliding_window` false, ...), or bookkeeping that
leaves the model as it is (BENIGN: the library's version, the dtype the
file was saved in, the special tokens' ids, initialization, caching and
dropout settings, which a forward without dropout does not read); any other
key is refused by name, a mixture-of-experts field among them. A key that
sets a field of the model must be present (transformers' defaults differ
between architectures and versions: stablelm's would rotate a quarter of each
head with 32 key-value heads); a key whose only value here is transformers'
default may be absent. rope_theta and partial_rotary_factor are read from
`rope_parameters` (transformers 5) or the top level (4), and must agree
where both are given; `rope_scaling` must be null, `rope_type` default, and
`head_dim`, where given, D/H. Numbers are read from their JSON text, so
1e-06 is exactly 1/1000000. The weights are model.safetensors, or shards
listed by model.safetensors.index.json (each listed shard present, every
tensor in exactly one shard, the shard the index names).

The tokenizer. tokenizer.json is the `tokenizers` library's own file: for a
run's, the byte-level BPE (SPEC 8) with a BPE model, the ByteLevel
pre-tokenizer without a prefix space, the ByteLevel decoder, no normalizer,
no post-processor, no special tokens. `PreTrainedTokenizerFast` is a
wrapper of exactly such a `tokenizers.Tokenizer` loaded from that file, so
its ids are the project's ids. tokenizer_config.json names that class
(stablelm's default class, GPTNeoXTokenizerFast, would bring its own special
tokens) and turns `clean_up_tokenization_spaces` off (on, `decode` deletes
the space before punctuation and text would not survive the round trip).
A run's V ids are all BPE tokens: there is no BOS, EOS or padding token, so
`tokenizer(text)` adds nothing and `generate` runs for `max_new_tokens`.
config.json and generation_config.json set those ids to null, because
transformers' defaults (id 0 for stablelm's BOS and EOS) would end
generation at whatever token 0 is. A tokenizer's ids must all be below the
model's V (SPEC 22): an imported model's vocabulary is often padded beyond
its tokenizer's. transformers 5 honours the named class for stablelm and
llama; for model_type qwen2 its AutoTokenizer is always Qwen2Tokenizer, which
rebuilds the tokenizer from tokenizer.json's vocabulary and merges with
Qwen2's own pre-tokenizer and an NFC normalizer: the same ids for a Qwen2
tokenizer, not always for another one (a run's BPE splits whitespace after a
newline otherwise). `PreTrainedTokenizerFast.from_pretrained(DIR)` loads
tokenizer.json as it is, for every architecture.

Publication. The directory is written whole into a temporary directory beside
DIR (each file published with fsutil.publish), then renamed to DIR: a missing
or empty DIR is replaced in one rename(2). A non-empty DIR is refused, unless
--force and it holds only files an export writes (a previous export), so that
--force never deletes anything else. That replacement takes two renames (the
old directory aside, the new one in); a crash between them leaves DIR absent,
with the complete new export beside it as `.DIR.*.tmp` and the old one as
`.DIR.*.old`, never a directory that mixes the two.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from fractions import Fraction

from coppelius.reference.config import PRESETS, Config, identity_number, parse_rational
from coppelius.reference.errors import ConfigError, CoppeliusError
from coppelius.reference.fsutil import fsync_directory, publish, signals_deferred
from coppelius.reference.params import registry
from coppelius.reference.sources import CheckpointSource, SafetensorsSource, _unique_keys

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = WEIGHTS + ".index.json"  # the shards' index (save_pretrained's max_shard_size)
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
# Every file an export may write: --force replaces a directory holding only these.
EXPORT_FILES = (CONFIG, GENERATION_CONFIG, WEIGHTS, "special_tokens_map.json", TOKENIZER,
                TOKENIZER_CONFIG)
MAX_JSON_BYTES = 1 << 20  # config files are a few hundred bytes; a larger one is not read
MAX_INDEX_BYTES = 64 << 20  # an index lists every tensor: a few hundred bytes per layer
MAX_TOKENIZER_BYTES = 64 << 20  # a BPE of V = 12288 is about 1 MB; 150 K ids about 10 MB

# SPEC 2 names -> transformers' names (SPEC 20, 21), the same in the three
# architectures. Per layer, the part after `layers.{l}.`.
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_norm.bias": "input_layernorm.bias",
    "attn.q.weight": "self_attn.q_proj.weight",
    "attn.q.bias": "self_attn.q_proj.bias",
    "attn.k.weight": "self_attn.k_proj.weight",
    "attn.k.bias": "self_attn.k_proj.bias",
    "attn.v.weight": "self_attn.v_proj.weight",
    "attn.v.bias": "self_attn.v_proj.bias",
    "attn.o.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp_norm.bias": "post_attention_layernorm.bias",
    "mlp.gate.weight": "mlp.gate_proj.weight",
    "mlp.up.weight": "mlp.up_proj.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
}
OUTER_NAMES = {
    "tok_embedding.weight": "model.embed_tokens.weight",
    "final_norm.weight": "model.norm.weight",
    "final_norm.bias": "model.norm.bias",
    "lm_head.weight": "lm_head.weight",  # tied: never written, checked if a file has it
}


class HfError(CoppeliusError):
    """A Hugging Face directory cannot be written or read as asked (names the
    file and the key)."""


def hf_name(name: str) -> str:
    """The transformers name of a SPEC parameter name."""
    if name in OUTER_NAMES:
        return OUTER_NAMES[name]
    _, layer, rest = name.split(".", 2)  # layers.{l}.<rest>
    return f"model.layers.{layer}.{LAYER_NAMES[rest]}"


def hf_names(config: Config) -> dict:
    """{SPEC name: transformers name} of every parameter and alias of `config`."""
    reg = registry(config)
    return {name: hf_name(name) for name in [s.name for s in reg.specs] + list(reg.aliases)}


# ------------------------------------------------------------------ architectures

@dataclass(frozen=True)
class Architecture:
    """One transformers architecture and the SPEC 21 members it is.

    `fixed`: (key, value, why, required) of config.json keys whose value is
    the same for every member (required: must be present, since
    transformers' default is not that value in every version); export
    writes them all but those in `unwritten` (fields SPEC 21 does not name,
    read for the checkpoints that have them). `extra`: keys of this
    architecture that leave the model as it is."""

    name: str  # "LlamaForCausalLM": config.json's architectures
    model_type: str
    norm: str  # layernorm | rmsnorm
    eps_key: str  # config.json's norm epsilon
    bias_key: str | None  # the key that sets qkv_bias; None: `qkv_bias` is the architecture's
    qkv_bias: bool  # where bias_key is None
    partial_rotary: bool  # partial_rotary_factor may be below 1
    fixed: tuple
    extra: tuple = ()
    unwritten: tuple = ()


SILU = ("hidden_act", "silu", "SwiGLU", True)
STABLELM = Architecture(
    name="StableLmForCausalLM", model_type="stablelm", norm="layernorm",
    eps_key="layer_norm_eps", bias_key="use_qkv_bias", qkv_bias=False, partial_rotary=True,
    fixed=(SILU, ("qk_layernorm", False, "no LayerNorm on queries and keys", True),
           ("use_parallel_residual", False, "the MLP follows attention", True)),
    extra=("hidden_dropout",))
LLAMA = Architecture(
    name="LlamaForCausalLM", model_type="llama", norm="rmsnorm", eps_key="rms_norm_eps",
    bias_key=None, qkv_bias=False, partial_rotary=False,
    fixed=(SILU, ("attention_bias", False, "no bias on q, k, v and o: with q, k and v biases "
                                           "a model is Qwen2ForCausalLM", False),
           ("mlp_bias", False, "no bias in the MLP", False),
           ("pretraining_tp", 1, "the products unsliced", False)),
    unwritten=("pretraining_tp",))
QWEN2 = Architecture(
    name="Qwen2ForCausalLM", model_type="qwen2", norm="rmsnorm", eps_key="rms_norm_eps",
    bias_key=None, qkv_bias=True, partial_rotary=False,
    fixed=(SILU, ("use_sliding_window", False, "full attention in every layer, no sliding "
                                               "window", False),
           ("use_mrope", False, "one rotary embedding of the positions", False)),
    extra=("sliding_window", "max_window_layers", "layer_types"),  # checked in _check_windows
    unwritten=("use_mrope",))
ARCHITECTURES = (STABLELM, LLAMA, QWEN2)

# config.json keys that leave the model as it is, in every architecture:
# bookkeeping (the library's version, the dtype the tensors were saved in,
# the path it was loaded from), the special tokens' ids (the forward reads
# none), initialization, caching and output switches of the library, and
# dropout (a training setting of transformers'; coppelius trains without).
BENIGN = ("architectures", "model_type", "transformers_version", "_name_or_path", "dtype",
          "torch_dtype", "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range",
          "use_cache", "attention_dropout", "output_attentions", "output_hidden_states",
          "return_dict", "tokenizer_class")
# Fields of transformers' mixture-of-experts models: refused with that name.
MOE_KEYS = ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
            "shared_expert_intermediate_size", "n_routed_experts", "n_shared_experts",
            "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef",
            "output_router_logits", "norm_topk_prob", "first_k_dense_replace", "moe_layer_freq")
# config.json keys -> Config fields: the shape of the model
SHAPE_KEYS = (("vocab", "vocab_size"), ("context", "max_position_embeddings"),
              ("d_model", "hidden_size"), ("n_layer", "num_hidden_layers"),
              ("n_head", "num_attention_heads"), ("d_ff", "intermediate_size"))
ROPE_KEYS = ("rope_theta", "partial_rotary_factor")  # also under rope_parameters
FIELD_KEYS = ("num_key_value_heads", "tie_word_embeddings", "head_dim", "rope_scaling",
              "rope_parameters") + ROPE_KEYS


def architecture(config: Config) -> Architecture:
    """The architecture that is exactly `config` (SPEC 21), or HfError naming
    the field that makes it none of them."""
    if config.norm == "layernorm":
        arch = STABLELM
    else:
        if config.rotary != 1:
            raise HfError(f"config field rotary={identity_number(config.rotary)}: an rmsnorm "
                          f"model is {LLAMA.name} or {QWEN2.name}, which rotate the whole head "
                          f"(partial rotary is {STABLELM.name}'s, with layernorm)")
        arch = QWEN2 if config.qkv_bias else LLAMA
    for field in ("norm_eps", "rope_base", "rotary"):  # written as JSON numbers
        value = getattr(config, field)
        if _number(float(value)) != value:
            raise HfError(f"config field {field}={identity_number(value)}: config.json writes "
                          f"it as the number {float(value)!r}, which is not that value")
    return arch


def _number(value) -> Fraction:
    """The exact rational a JSON number's text writes (1e-06 is 1/1000000)."""
    return parse_rational(repr(value) if isinstance(value, float) else str(value), "number")


# ------------------------------------------------------------------ config files

def config_json(config: Config, dtype: str) -> dict:
    """config.json of a coppelius model whose tensors are `dtype`."""
    arch = architecture(config)
    out = {
        "architectures": [arch.name],
        "model_type": arch.model_type,
        "vocab_size": config.vocab,
        "hidden_size": config.d_model,
        "intermediate_size": config.d_ff,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.kv_heads,
    }
    if arch is STABLELM:
        out.update({"partial_rotary_factor": float(config.rotary),
                    "rope_theta": float(config.rope_base),
                    "layer_norm_eps": float(config.norm_eps)})
    else:
        out.update({"head_dim": config.head_dim, "rope_theta": float(config.rope_base),
                    "rope_scaling": None, "rms_norm_eps": float(config.norm_eps)})
    out.update({"max_position_embeddings": config.context,
                "tie_word_embeddings": config.tied})
    if arch.bias_key:
        out[arch.bias_key] = config.qkv_bias
    out.update({key: value for key, value, _, _ in arch.fixed if key not in arch.unwritten})
    if arch is QWEN2:
        out["sliding_window"] = None
    if arch is STABLELM:
        out["hidden_dropout"] = 0.0
    out.update({"attention_dropout": 0.0, "bos_token_id": None, "eos_token_id": None,
                "pad_token_id": None, "torch_dtype": dtype})
    return out


def tokenizer_eos(body: bytes):
    """(token, id) of the end-of-text token a tokenizer.json defines, or
    None (SPEC 22): `<|endoftext|>` where it is a token of it, else its one
    special added token (a run's BPE trained with --eos has exactly that)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(body.decode("utf-8"))
    token_id = tokenizer.token_to_id("<|endoftext|>")
    if token_id is not None:
        return "<|endoftext|>", token_id
    special = [t for t in json.loads(body).get("added_tokens") or [] if t.get("special")]
    if len(special) == 1 and isinstance(special[0].get("content"), str):
        return special[0]["content"], tokenizer.token_to_id(special[0]["content"])
    return None


def tokenizer_config_json(config: Config, eos: str | None = None) -> dict:
    out = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "model_max_length": config.context,
    }
    if eos is not None:  # the documents' separator: generate stops at it
        out["eos_token"] = eos
    return out


def generation_config_json(eos_id: int | None = None) -> dict:
    return {"do_sample": True, "temperature": 0.8, "top_k": 40,
            "bos_token_id": None, "eos_token_id": eos_id, "pad_token_id": None}


def json_bytes(value: dict) -> bytes:
    return (json.dumps(value, indent=2) + "\n").encode("utf-8")


def _show(value) -> str:
    return json.dumps(value)


def _same(value, want) -> bool:
    """JSON equality without bool == int (true is not 1, 10000 is 10000.0)."""
    if isinstance(want, bool) or isinstance(value, bool):
        return value is want
    if isinstance(want, float):
        return isinstance(value, (int, float)) and value == want
    return value == want


def _architecture_of(cfg: dict, fail) -> Architecture:
    model_type = cfg.get("model_type")
    arch = next((a for a in ARCHITECTURES if a.model_type == model_type), None)
    if arch is None:
        known = ", ".join(f'"{a.model_type}" ({a.name})' for a in ARCHITECTURES)
        raise fail("model_type", f"is {_show(model_type)}: a coppelius model is one of {known}")
    if "architectures" in cfg and cfg["architectures"] != [arch.name]:
        raise fail("architectures", f"is {_show(cfg['architectures'])}, not [\"{arch.name}\"] "
                                    f"(model_type {arch.model_type})")
    return arch


def _check_keys(cfg: dict, arch: Architecture, fail) -> None:
    """Every key of config.json is one SPEC 21 defines for the architecture."""
    known = set(BENIGN) | {key for _, key in SHAPE_KEYS} | set(FIELD_KEYS) | set(arch.extra) \
        | {arch.eps_key} | {key for key, _, _, _ in arch.fixed} | {arch.bias_key} - {None}
    for key in cfg:
        if key in MOE_KEYS:
            raise fail(key, f"is {_show(cfg[key])}: a mixture-of-experts field; a coppelius "
                            f"model has one dense MLP per layer")
        if key not in known:
            raise fail(key, f"is not a field of a coppelius model ({arch.name}, SPEC 21)")


def _positive_number(value, name: str, fail) -> Fraction:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
            or not math.isfinite(value):
        raise fail(name, f"is {_show(value)}: not a positive number")
    return _number(value)


def _rope(cfg: dict, arch: Architecture, fail) -> dict:
    """{key: (value, the name it was read under)} of rope_theta and
    partial_rotary_factor, read from rope_parameters or the top level."""
    rope = cfg.get("rope_parameters")
    if rope is not None:
        if not isinstance(rope, dict):
            raise fail("rope_parameters", f"is {_show(rope)}, not an object")
        if rope.get("rope_type", "default") != "default":
            raise fail("rope_parameters", f"rope_type is {_show(rope['rope_type'])}: a coppelius "
                                          "model has the default rotary embedding (no scaling)")
        for key in rope:
            if key not in ("rope_type",) + ROPE_KEYS:
                raise fail(f"rope_parameters.{key}", f"is {_show(rope[key])}: a coppelius "
                                                     f"model has the default rotary embedding")
    if cfg.get("rope_scaling") is not None:
        raise fail("rope_scaling", f"is {_show(cfg['rope_scaling'])}: a coppelius model has no "
                                   "rotary scaling")
    out = {}
    for key in ROPE_KEYS:
        inside = rope is not None and key in rope
        if inside and key in cfg and not _same(cfg[key], rope[key]):
            raise fail(key, f"is {_show(cfg[key])} but rope_parameters.{key} is "
                            f"{_show(rope[key])}")
        if inside:
            out[key] = (rope[key], f"rope_parameters.{key}")
        elif key in cfg:
            out[key] = (cfg[key], key)
    return out


def _check_windows(cfg: dict, fail) -> None:
    """Qwen2: full attention in every layer. `sliding_window` and
    `max_window_layers` apply only with use_sliding_window (refused), and
    layer_types, where given, names full attention alone."""
    types = cfg.get("layer_types")
    if types is not None and (not isinstance(types, list) or len(types) != cfg.get(
            "num_hidden_layers") or any(t != "full_attention" for t in types)):
        raise fail("layer_types", f"is {_show(types)}: a coppelius model has full attention "
                                  f"(\"full_attention\") in each of its num_hidden_layers layers")


MISSING = object()  # a key config.json does not have


def model_of(cfg: dict, where: str) -> Config:
    """The coppelius Config a config.json describes (see the module doc);
    anything that makes it another model is refused, naming the key (HfError)."""
    def fail(key, why):
        return HfError(f"{where}: {key} {why}")

    arch = _architecture_of(cfg, fail)
    _check_keys(cfg, arch, fail)
    sizes = {}
    for field, key in SHAPE_KEYS:
        if key not in cfg:
            raise fail(key, "is missing")
        value = cfg[key]
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise fail(key, f"is {_show(value)}: not a positive integer")
        sizes[field] = value
    try:
        shape = Config(**sizes)
    except ConfigError as e:
        raise HfError(f"{where}: not a shape a coppelius model has ({e})") from None
    rope = _rope(cfg, arch, fail)
    for key, want, why, required in arch.fixed:
        if key not in cfg:
            if required:
                raise fail(key, f"is missing (a coppelius model has {_show(want)}: {why})")
        elif not _same(cfg[key], want):
            raise fail(key, f"is {_show(cfg[key])}; a coppelius model has {_show(want)} ({why})")
    if arch is QWEN2:
        _check_windows(cfg, fail)
    fields = {"norm": arch.norm}  # field -> value, each checked alone to name its key
    for field, key in (("n_kv_head", "num_key_value_heads"), ("tied", "tie_word_embeddings"),
                       ("norm_eps", arch.eps_key), ("rope_base", "rope_theta"),
                       ("rotary", "partial_rotary_factor"), ("qkv_bias", arch.bias_key)):
        value, name = rope.get(key) or ((cfg[key], key) if key in cfg else (MISSING, key))
        if field == "rotary" and not arch.partial_rotary:
            if value is not MISSING and not _same(value, 1.0):
                raise fail(name, f"is {_show(value)}; {arch.name} rotates the whole head (1.0; "
                                 f"partial rotary is {STABLELM.name}'s)")
            continue
        if field == "qkv_bias" and key is None:
            fields[field] = arch.qkv_bias
            continue
        if value is MISSING or value is None:
            raise fail(name, f"is {'missing' if value is MISSING else 'null'} (it sets the "
                             f"model's {field}; transformers' defaults differ between "
                             f"architectures and versions)")
        raw = value
        if field in ("tied", "qkv_bias"):
            if not isinstance(value, bool):
                raise fail(name, f"is {_show(value)}: not true or false")
        elif field == "n_kv_head":
            if isinstance(value, bool) or not isinstance(value, int):
                raise fail(name, f"is {_show(value)}: not a positive integer")
        else:
            value = _positive_number(value, name, fail)
        try:
            dataclasses.replace(shape, **{field: value})
        except ConfigError as e:
            raise fail(name, f"is {_show(raw)}: {e}") from None
        fields[field] = value
    config = dataclasses.replace(shape, **fields)
    if "head_dim" in cfg and not _same(cfg["head_dim"], config.head_dim):
        raise fail("head_dim", f"is {_show(cfg['head_dim'])}; a coppelius model has "
                               f"{config.head_dim} (hidden_size {config.d_model} / "
                               f"num_attention_heads {config.n_head})")
    return config


def preset_of(config: Config) -> str | None:
    for name, candidate in PRESETS.items():
        if candidate.identity() == config.identity():
            return name
    return None


# ------------------------------------------------------------------ reading a directory

def read_file(path: str, limit: int, what: str) -> bytes:
    """The bytes of a regular file of at most `limit` bytes (a FIFO or a
    device is refused before it is opened: reading one would block or never end)."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise HfError(f"{path}: not a regular file")
        if st.st_size > limit:
            raise HfError(f"{path}: {st.st_size} bytes, more than a {what} has ({limit})")
        with open(path, "rb") as f:
            return f.read(limit + 1)
    except OSError as e:
        raise HfError(f"{path}: cannot read: {e.strerror or e}") from None


def read_json(path: str, limit: int = MAX_JSON_BYTES, what: str = "configuration file") -> dict:
    raw = read_file(path, limit, what)
    try:
        value = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        detail = (str(e).splitlines() or [type(e).__name__])[0]
        raise HfError(f"{path}: not UTF-8 JSON ({detail})") from None
    if not isinstance(value, dict):
        raise HfError(f"{path}: a JSON {type(value).__name__}, not an object")
    return value


def is_directory(path) -> bool:
    return os.path.isdir(os.fspath(path))


def read_config(directory: str) -> Config:
    """The model a directory's config.json describes."""
    path = os.path.join(directory, CONFIG)
    if not os.path.lexists(path):
        raise HfError(f"{directory}: no {CONFIG} (not a Hugging Face model directory)")
    return model_of(read_json(path), path)


def _regular(path: str) -> bool:
    """Whether `path` is a regular file (False: absent); a FIFO or a
    directory there is refused (opening a FIFO would block)."""
    if not os.path.lexists(path):
        return False
    try:
        regular = stat.S_ISREG(os.stat(path).st_mode)
    except OSError as e:
        raise HfError(f"{path}: cannot read: {e.strerror or e}") from None
    if not regular:
        raise HfError(f"{path}: not a regular file")
    return True


def weights_source(directory: str):
    """The directory's weights as one checkpoint source: DIR/model.safetensors,
    or the shards DIR/model.safetensors.index.json lists (ShardedSource). A
    directory with the weights in another form is refused, naming the form."""
    single, index = os.path.join(directory, WEIGHTS), os.path.join(directory, INDEX)
    if _regular(single):
        if os.path.lexists(index):
            raise HfError(f"{directory}: holds both {WEIGHTS} and {INDEX}; which are the "
                          f"weights? (remove the one that is not)")
        return SafetensorsSource(single)
    if _regular(index):
        return ShardedSource(index)
    if os.path.lexists(os.path.join(directory, "pytorch_model.bin")):
        raise HfError(f"{directory}: the weights are pytorch_model.bin, a pickle, which "
                      f"coppelius never loads; it reads {WEIGHTS}")
    raise HfError(f"{directory}: no {WEIGHTS}")


class ShardedSource(CheckpointSource):
    """The shards of model.safetensors.index.json as one source (SPEC 12):
    the index's `weight_map` names, for every tensor, the shard that holds it.
    Refused at construction, naming the shard or the tensor: a shard name
    that is not a file beside the index, a listed shard that is missing, a
    tensor the index lists in a shard that does not hold it, a tensor a
    shard holds that the index does not list there (in no shard, or in two).
    Leases are the shards' own (each a SafetensorsSource, its header checked);
    the metadata is the shards' (save_pretrained writes the same to each),
    refused where two shards disagree."""

    def __init__(self, path):
        super().__init__(path)
        index = read_json(self.path, MAX_INDEX_BYTES, "shard index")
        for key in index:
            if key not in ("metadata", "weight_map"):
                raise HfError(f"{self.path}: {key} is not a key of a shard index "
                              f"(metadata, weight_map)")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise HfError(f"{self.path}: weight_map is {_show(weight_map)}, not an object "
                          f"naming each tensor's shard")
        directory = os.path.dirname(self.path)
        self._shards, self._where = {}, {}
        try:
            for key, shard in weight_map.items():
                if not isinstance(shard, str) or not shard or os.path.basename(shard) != shard \
                        or shard in (".", ".."):
                    raise HfError(f"{self.path}: weight_map.{key} is {_show(shard)}, not the "
                                  f"name of a file beside the index")
                if shard not in self._shards:
                    shard_path = os.path.join(directory, shard)
                    if not _regular(shard_path):
                        raise HfError(f"{self.path}: shard {shard} (of {key}) is missing")
                    self._shards[shard] = SafetensorsSource(shard_path)
                self._where[key] = shard
            for shard, source in self._shards.items():
                for key in source.tensors():
                    if self._where.get(key) != shard:
                        listed = (f"lists it in {self._where[key]}" if key in self._where
                                  else "does not list it")
                        raise HfError(f"{self.path}: tensor {key} is in shard {shard}, but the "
                                      f"index {listed}")
            for key, shard in self._where.items():
                if key not in self._shards[shard].tensors():
                    raise HfError(f"{self.path}: tensor {key} is listed in shard {shard}, "
                                  f"which does not hold it")
                self._tensors[key] = self._shards[shard].tensors()[key]
            self.metadata = self._metadata()
        except BaseException:
            self.close()
            raise

    def _metadata(self) -> dict:
        first, *rest = self._shards.items()
        for shard, source in rest:
            if source.metadata != first[1].metadata:
                raise HfError(f"{self.path}: shards {first[0]} and {shard} have different "
                              f"metadata")
        return dict(first[1].metadata)

    def _read(self, key, start, stop):
        return self._shards[self._where[key]]._read(key, start, stop)

    def close(self) -> None:
        for source in self._shards.values():
            source.close()


def load_tokenizer_bytes(body: bytes, path: str, config: Config):
    """A tokenizer.json's bytes as a `tokenizers.Tokenizer`, refused unless
    every id it produces is below the model's V (SPEC 22) and stands for one
    token (coppelius.tokenizer's checks)."""
    from tokenizers import Tokenizer

    from coppelius.tokenizer import shared_id, tokenizer_ids

    try:
        tokenizer = Tokenizer.from_str(body.decode("utf-8"))
    except Exception as e:  # tokenizers raises a bare Exception on a bad file
        detail = (str(e).splitlines() or [type(e).__name__])[0]
        raise HfError(f"tokenizer {path}: cannot load ({detail})") from None
    ids = tokenizer_ids(tokenizer)
    if ids > config.vocab:
        raise HfError(f"tokenizer {path}: has {ids} ids, more than the model's V={config.vocab}")
    shared = shared_id(tokenizer)
    if shared is not None:
        raise HfError(f"tokenizer {path}: {shared}")
    return tokenizer


def directory_tokenizer(directory: str, config: Config) -> str | None:
    """SHA-256 of the directory's tokenizer.json (checked to fit the model's
    V), or None when it has none."""
    path = os.path.join(directory, TOKENIZER)
    if not os.path.lexists(path):
        return None
    body = read_file(path, MAX_TOKENIZER_BYTES, "tokenizer")
    load_tokenizer_bytes(body, path, config)
    return hashlib.sha256(body).hexdigest()


# ------------------------------------------------------------------ publication

def check_target(path: str, force: bool) -> bool:
    """Whether publishing directory `path` replaces a previous export (True)
    or takes a missing or empty DIR (False); anything else is refused.
    `path` is taken without trailing separators (`link/` would follow a link)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as e:
        raise HfError(f"{path}: cannot inspect: {e.strerror or e}") from None
    if stat.S_ISLNK(st.st_mode):
        raise HfError(f"{path}: is a symbolic link; give the directory it points to")
    if not stat.S_ISDIR(st.st_mode):
        raise HfError(f"{path}: exists and is not a directory")
    try:
        entries = sorted(os.listdir(path))
    except OSError as e:
        raise HfError(f"{path}: cannot list: {e.strerror or e}") from None
    if not entries:
        return False
    if not force:
        raise HfError(f"{path}: exists and is not empty (pass --force to replace a previous "
                      f"export)")
    for name in entries:
        if name not in EXPORT_FILES or not stat.S_ISREG(os.lstat(os.path.join(path, name)).st_mode):
            raise HfError(f"{path}: holds {name}, which no export writes; --force replaces "
                          f"only a previous export")
    if CONFIG not in entries:
        raise HfError(f"{path}: has no {CONFIG}, so it is no previous export; --force "
                      f"replaces only a previous export")
    return True


def publish_directory(path: str, files: dict, replace: bool) -> None:
    """Publish directory `path` holding `files` {name: bytes} (see the module
    doc); `replace` as check_target said. Raises OSError, leaving `path` as it was.
    A signal (SIGTERM, Ctrl-C) is held over the steps that make, swap and
    remove the folders, so that it never leaves one of them behind: the old
    export aside, or the new one half removed."""
    parent = os.path.dirname(os.path.abspath(path))
    base = os.path.basename(os.path.abspath(path))
    tmp = old = None
    try:
        with signals_deferred():
            tmp = tempfile.mkdtemp(prefix=f".{base}.", suffix=".tmp", dir=parent)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; a published directory is ordinary
        for name, body in files.items():
            publish(os.path.join(tmp, name), lambda f, body=body: f.write(body))
        with signals_deferred():
            if replace:
                # rename(2) replaces only an empty directory: the old export goes
                # aside (over an empty placeholder), then the new one comes in
                old = tempfile.mkdtemp(prefix=f".{base}.", suffix=".old", dir=parent)
                os.replace(path, old)
                try:
                    os.replace(tmp, path)
                except BaseException:
                    aside, old = old, None  # deleted only once it is back in place
                    os.replace(aside, path)
                    raise
            else:
                os.replace(tmp, path)  # a missing DIR, or an empty one
            tmp = None
        fsync_directory(parent)
    finally:
        with signals_deferred():
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
