"""The Hugging Face model directory (SPEC section 20).

The model of SPEC sections 1 to 3 is exactly `transformers`'
`StableLmForCausalLM` with rotary embeddings on the whole head
(`partial_rotary_factor` 1.0, half-split pairs as `rotate_half` makes them),
LayerNorm with a bias, no bias on q, k and v, no LayerNorm on q and k,
sequential residuals, SwiGLU (`silu`) and tied embeddings. So a coppelius
model is written as a directory that `AutoModelForCausalLM` and
`AutoTokenizer` load with no custom code:

    config.json             the StableLmConfig fields (config_json)
    model.safetensors       the parameters under transformers' names (HF_NAMES),
                            float32 or bfloat16, without the tied lm_head.weight;
                            metadata "format": "pt" (transformers loads no file
                            without it) and the checkpoint's identities, step and
                            contexts, as `coppelius export` always writes them
    tokenizer.json          the run's tokenizer, byte for byte: its SHA-256 stays
                            the one the data identity names
    tokenizer_config.json   a PreTrainedTokenizerFast over tokenizer.json
    generation_config.json  `coppelius sample`'s defaults (sampling, temperature
                            0.8, top-k 40)

The tokenizer. tokenizer.json is the `tokenizers` library's own file of the
byte-level BPE (SPEC 8): a BPE model, the ByteLevel pre-tokenizer without a
prefix space, the ByteLevel decoder, no normalizer, no post-processor, no
special tokens. `PreTrainedTokenizerFast` is a wrapper of exactly such a
`tokenizers.Tokenizer` loaded from that file, so its ids are the project's
ids. tokenizer_config.json names that class (stablelm's default class,
GPTNeoXTokenizerFast, would bring its own special tokens) and turns
`clean_up_tokenization_spaces` off (on, `decode` deletes the space before
punctuation and text would not survive the round trip). The V ids are all
BPE tokens: there is no BOS, EOS or padding token, so `tokenizer(text)` adds
nothing and `generate` runs for `max_new_tokens`. config.json and
generation_config.json set those ids to null, because transformers' stablelm
defaults (id 0 for BOS and EOS) would end generation at whatever token 0 is.

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

import hashlib
import json
import os
import shutil
import stat
import tempfile

from coppelius.reference.config import LAYERNORM_EPS, PRESETS, ROPE_BASE, Config
from coppelius.reference.errors import ConfigError, CoppeliusError
from coppelius.reference.fsutil import fsync_directory, publish
from coppelius.reference.params import registry
from coppelius.reference.sources import _unique_keys

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
# Every file an export may write: --force replaces a directory holding only these.
EXPORT_FILES = (CONFIG, GENERATION_CONFIG, WEIGHTS, "special_tokens_map.json", TOKENIZER,
                TOKENIZER_CONFIG)
ARCHITECTURE = "StableLmForCausalLM"
MAX_JSON_BYTES = 1 << 20  # config files are a few hundred bytes; a larger one is not read
MAX_TOKENIZER_BYTES = 64 << 20  # a BPE of V = 12288 is about 1 MB

# SPEC 2 names -> transformers' names (SPEC 20). Per layer, the part after `layers.{l}.`.
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_norm.bias": "input_layernorm.bias",
    "attn.q.weight": "self_attn.q_proj.weight",
    "attn.k.weight": "self_attn.k_proj.weight",
    "attn.v.weight": "self_attn.v_proj.weight",
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


# ------------------------------------------------------------------ config files

def config_json(config: Config, dtype: str) -> dict:
    """config.json of a coppelius model whose tensors are `dtype`."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "stablelm",
        "vocab_size": config.vocab,
        "hidden_size": config.d_model,
        "intermediate_size": config.d_ff,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_head,
        "partial_rotary_factor": 1.0,
        "rope_theta": float(ROPE_BASE),
        "layer_norm_eps": float(LAYERNORM_EPS),
        "max_position_embeddings": config.context,
        "tie_word_embeddings": True,
        "use_qkv_bias": False,
        "qk_layernorm": False,
        "use_parallel_residual": False,
        "hidden_act": "silu",
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "torch_dtype": dtype,
    }


def tokenizer_config_json(config: Config) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "model_max_length": config.context,
    }


def generation_config_json() -> dict:
    return {"do_sample": True, "temperature": 0.8, "top_k": 40,
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


def json_bytes(value: dict) -> bytes:
    return (json.dumps(value, indent=2) + "\n").encode("utf-8")


# config.json keys -> Config fields: the shape of the model
SHAPE_KEYS = (("vocab", "vocab_size"), ("context", "max_position_embeddings"),
              ("d_model", "hidden_size"), ("n_layer", "num_hidden_layers"),
              ("n_head", "num_attention_heads"), ("d_ff", "intermediate_size"))
# config.json keys whose value is fixed for every coppelius model, and what the
# model would be otherwise (the refusal says it)
FIXED_KEYS = (
    ("tie_word_embeddings", True, "lm_head.weight is model.embed_tokens.weight"),
    ("use_qkv_bias", False, "q, k and v have no bias"),
    ("qk_layernorm", False, "no LayerNorm on queries and keys"),
    ("use_parallel_residual", False, "the MLP follows attention"),
    ("hidden_act", "silu", "SwiGLU"),
    ("layer_norm_eps", float(LAYERNORM_EPS), "LayerNorm epsilon 1/100000"),
    ("rope_theta", float(ROPE_BASE), f"rotary base {ROPE_BASE}"),
    ("partial_rotary_factor", 1.0, "rotary embedding of the whole head"),
)
ROPE_KEYS = ("rope_theta", "partial_rotary_factor")  # also under rope_parameters


def _show(value) -> str:
    return json.dumps(value)


def _same(value, want) -> bool:
    """JSON equality without bool == int (true is not 1, 10000 is 10000.0)."""
    if isinstance(want, bool) or isinstance(value, bool):
        return value is want
    if isinstance(want, float):
        return isinstance(value, (int, float)) and value == want
    return value == want


def model_of(cfg: dict, where: str) -> Config:
    """The coppelius Config a config.json describes; anything that makes it
    another model is refused, naming the key (HfError).

    Every key below must be present: where transformers would fill in a
    default, that default is stablelm's (untied embeddings, a quarter of the
    head rotated, 32 key-value heads), not this model's. transformers 5
    writes rope_theta and partial_rotary_factor under rope_parameters; both
    places are read, rope_parameters first, as transformers does."""
    def fail(key, why):
        return HfError(f"{where}: {key} {why}")

    model_type = cfg.get("model_type")
    if model_type != "stablelm":
        raise fail("model_type", f"is {_show(model_type)}: a coppelius model is \"stablelm\" "
                                 f"({ARCHITECTURE})")
    if "architectures" in cfg and cfg["architectures"] != [ARCHITECTURE]:
        raise fail("architectures", f"is {_show(cfg['architectures'])}, not [\"{ARCHITECTURE}\"]")
    sizes = {}
    for field, key in SHAPE_KEYS:
        if key not in cfg:
            raise fail(key, "is missing")
        value = cfg[key]
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise fail(key, f"is {_show(value)}: not a positive integer")
        sizes[field] = value
    try:
        config = Config(**sizes)
    except ConfigError as e:
        raise HfError(f"{where}: not a shape a coppelius model has ({e})") from None
    for key, want in (("num_key_value_heads", config.n_head), ("head_dim", config.head_dim)):
        if key == "head_dim" and key not in cfg:
            continue  # stablelm derives it; other writers may state it
        if key not in cfg:
            raise fail(key, f"is missing (a coppelius model has {want}: no grouped-query attention)")
        if not _same(cfg[key], want):
            raise fail(key, f"is {_show(cfg[key])}; a coppelius model has {want} "
                            f"(num_attention_heads {config.n_head}, head dim {config.head_dim})")
    rope = cfg.get("rope_parameters")
    if rope is not None:
        if not isinstance(rope, dict):
            raise fail("rope_parameters", f"is {_show(rope)}, not an object")
        if rope.get("rope_type", "default") != "default":
            raise fail("rope_parameters", f"rope_type is {_show(rope['rope_type'])}: a coppelius "
                                          "model has the default rotary embedding (no scaling)")
    if cfg.get("rope_scaling") is not None:
        raise fail("rope_scaling", f"is {_show(cfg['rope_scaling'])}: a coppelius model has no "
                                   "rotary scaling")
    for key, want, why in FIXED_KEYS:
        if key in ROPE_KEYS and rope is not None and key in rope:
            value, name = rope[key], f"rope_parameters.{key}"
        elif key in cfg:
            value, name = cfg[key], key
        else:
            raise fail(key, f"is missing (a coppelius model has {_show(want)}: {why})")
        if not _same(value, want):
            raise fail(name, f"is {_show(value)}; a coppelius model has {_show(want)} ({why})")
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


def read_json(path: str) -> dict:
    raw = read_file(path, MAX_JSON_BYTES, "configuration file")
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


def weights_path(directory: str) -> str:
    """DIR/model.safetensors; a directory with the weights in another form is
    refused, naming the form."""
    path = os.path.join(directory, WEIGHTS)
    if os.path.lexists(path):
        try:
            regular = stat.S_ISREG(os.stat(path).st_mode)
        except OSError as e:
            raise HfError(f"{path}: cannot read: {e.strerror or e}") from None
        if not regular:  # opening a FIFO would block
            raise HfError(f"{path}: not a regular file")
        return path
    if os.path.lexists(os.path.join(directory, WEIGHTS + ".index.json")):
        raise HfError(f"{directory}: the weights are sharded ({WEIGHTS}.index.json); "
                      f"coppelius reads one {WEIGHTS}")
    if os.path.lexists(os.path.join(directory, "pytorch_model.bin")):
        raise HfError(f"{directory}: the weights are pytorch_model.bin, a pickle, which "
                      f"coppelius never loads; it reads {WEIGHTS}")
    raise HfError(f"{directory}: no {WEIGHTS}")


def load_tokenizer_bytes(body: bytes, path: str, config: Config):
    """A tokenizer.json's bytes as a `tokenizers.Tokenizer`, refused unless it
    has exactly the model's V ids."""
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_str(body.decode("utf-8"))
    except Exception as e:  # tokenizers raises a bare Exception on a bad file
        detail = (str(e).splitlines() or [type(e).__name__])[0]
        raise HfError(f"tokenizer {path}: cannot load ({detail})") from None
    ids = tokenizer.get_vocab_size(with_added_tokens=True)
    if ids != config.vocab:
        raise HfError(f"tokenizer {path}: has {ids} ids, the model has V={config.vocab}")
    return tokenizer


def directory_tokenizer(directory: str, config: Config) -> str | None:
    """SHA-256 of the directory's tokenizer.json (checked to have V ids), or
    None when it has none."""
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
    doc); `replace` as check_target said. Raises OSError, leaving `path` as it was."""
    parent = os.path.dirname(os.path.abspath(path))
    base = os.path.basename(os.path.abspath(path))
    tmp = tempfile.mkdtemp(prefix=f".{base}.", suffix=".tmp", dir=parent)
    old = None
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; a published directory is ordinary
        for name, body in files.items():
            publish(os.path.join(tmp, name), lambda f, body=body: f.write(body))
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
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
