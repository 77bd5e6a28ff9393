"""`coppelius export` and `coppelius import`: checkpoints to and from
safetensors files and Hugging Face model directories.

export CHECKPOINT OUT [--format safetensors|hf] [--dtype float32|bfloat16] [--moments]
                      [--tokenizer FILE | --no-tokenizer] [--force]
    safetensors (the default): OUT is one file. The parameters under their
    SPEC names (section 2), without `lm_head.weight` (tied to
    `tok_embedding.weight`, so not stored); with --moments also `m/<name>`
    and `v/<name>`. The metadata (str -> str) holds the checkpoint's
    identities (schema, model, learner, data, initialization, chunk_bytes)
    and its step and contexts.
    hf: OUT is a directory that transformers loads with no custom code
    (coppelius.hf, SPEC 20 and 21): config.json of the architecture that is
    exactly the model (StableLmForCausalLM for layernorm, LlamaForCausalLM
    for rmsnorm, Qwen2ForCausalLM for rmsnorm with q, k, v biases; any other
    member is refused by name), model.safetensors (transformers' names, the
    same metadata), the run's tokenizer.json with
    tokenizer_config.json, generation_config.json. The tokenizer is the
    tokenizer.json whose SHA-256 the data identity names, found where
    `coppelius sample` looks (beside the checkpoint, then the stream caches),
    or --tokenizer FILE (which must be that one when the checkpoint names
    one); --no-tokenizer writes the model alone.
    --dtype bfloat16 rounds every tensor to the nearest bfloat16, ties to
    even (reference.precision.round_bf16): half the bytes.

import IN CHECKPOINT [--preset NAME] [--precision fp32|bf16]
    IN is a safetensors file with SPEC names, or a Hugging Face directory
    with transformers' names whose config.json describes a coppelius model
    (coppelius.hf.model_of refuses anything else by name): one an export
    wrote, or one transformers' save_pretrained wrote (a StableLm, Llama or
    Qwen2 model; its weights in one file or in shards). Binds the tensors
    by name through the binding layer (SPEC 12) and writes a checkpoint that
    starts a run afresh: step 0, contexts 0, zero moments (moments in the
    file are not carried over; AdamW's bias correction restarts at step 1
    with them zero). bfloat16 and float16 tensors are widened to float32
    exactly. A stored tied head (`lm_head.weight`) must equal the embedding
    bit for bit. A directory's tokenizer.json is copied beside CHECKPOINT
    (unless a tokenizer.json is there already), where `sample`, `export`
    and `train` find a checkpoint's tokenizer. The model (a preset where one matches, else the model
    identity alone) then comes with the checkpoint: `coppelius train
    --checkpoint CHECKPOINT` fine-tunes it with no --preset.

    Identities come from the file's metadata when it has them (a file that
    `export` wrote); otherwise, documented defaults:
      model           a directory's config.json, else the --preset's
      learner         the default AdamW hyperparameters, precision --precision (fp32)
      data            batch --batch (1), tokenizer --tokenizer-sha, else the SHA-256
                      of a directory's tokenizer.json, else none; stream=none:
                      train on it with `coppelius train --new-data`, which lifts
                      only the stream part
      initialization  seed 20260925 (the values are the file's; the identity names
                      the generator a fresh run of this model would use)
    --precision given with a metadata learner identity replaces only its precision.

So the round trip checkpoint -> export (either format) -> import keeps the
parameters P byte for byte (a bfloat16 export: round_bf16(P)) and every
identity; the moments and the step are not carried (zero M and V, step 0).

A file is published atomically (a temporary in the same directory, fsync,
rename), a directory as coppelius.hf.publish_directory says; an existing
output is refused unless --force (for a directory: only a previous export).
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import stat

import ml_dtypes
import numpy as np
from safetensors.numpy import save as safetensors_bytes

from coppelius import hf
from coppelius.plan import publish_tokenizer
from coppelius.reference.binding import (Alias, Bind, Cast, NumpyBackend, RecipeBind, Tensor,
                                         UnexpectedValue, bind, bind_vectors, check_bindings,
                                         flatten)
from coppelius.reference.checkpoint import CHUNK_BYTES, IDENTITY_KEYS, write_checkpoint
from coppelius.reference.config import (PRECISIONS, PRESETS, SEED, Config, Hyper,
                                        config_from_identity,
                                        data_identity, initialization_identity,
                                        parameter_count, preset, schema_identity, tensor_count)
from coppelius.reference.errors import ConfigError, CoppeliusError
from coppelius.reference.fsutil import Lock, output_target, path_argument, publish, same_file
from coppelius.reference.params import registry
from coppelius.reference.precision import round_bf16
from coppelius.reference.schedule import learner_from_identity
from coppelius.reference.sources import CheckpointFileSource, SafetensorsSource, moment_key
from coppelius.reference.state import State

METADATA_KEYS = IDENTITY_KEYS + ("step", "contexts")
SHA256 = re.compile(r"[0-9a-f]{64}")
FORMATS = ("safetensors", "hf")
DTYPES = ("float32", "bfloat16")
WIDENED = ("bfloat16", "float16")  # imported as float32 exactly (every value of each is one)


class ExchangeError(CoppeliusError):
    """A file cannot be exported or imported as asked (names the file and field)."""


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "export", help="write a checkpoint's parameters as safetensors or a Hugging Face directory",
        description="Write the parameters of CHECKPOINT (SPEC names, no tied lm_head.weight) "
                    "to the safetensors file OUT with the checkpoint's identities, step and "
                    "contexts as metadata; with --format hf, write the directory OUT that "
                    "transformers' AutoModelForCausalLM and AutoTokenizer load.")
    p.add_argument("checkpoint", metavar="CHECKPOINT", type=path_argument)
    p.add_argument("out", metavar="OUT", type=path_argument)
    p.add_argument("--format", choices=FORMATS, default="safetensors",
                   help="safetensors: one file with SPEC names (default); hf: a Hugging Face "
                        "model directory (StableLmForCausalLM, LlamaForCausalLM or "
                        "Qwen2ForCausalLM, the one that is the model)")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="tensor dtype; bfloat16 rounds to nearest even, half the size "
                        "(default float32)")
    p.add_argument("--moments", action="store_true",
                   help="also write the AdamW moments as m/<name> and v/<name> "
                        "(--format safetensors, float32)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--tokenizer", metavar="FILE", type=path_argument,
                       help="--format hf: the run's tokenizer.json (default: the one whose "
                            "SHA-256 the checkpoint names, found where `coppelius sample` looks)")
    which.add_argument("--no-tokenizer", action="store_true",
                       help="--format hf: write the model without a tokenizer")
    p.add_argument("--force", action="store_true",
                   help="replace OUT if it exists (a directory: only a previous export)")
    p.set_defaults(func=run_export)

    p = subparsers.add_parser(
        "import", help="make a checkpoint from a safetensors file or a Hugging Face directory",
        description="Bind the tensors of IN (a safetensors file with SPEC names, or a Hugging "
                    "Face directory of a StableLm, Llama or Qwen2 model, as `export --format "
                    "hf` or transformers' save_pretrained wrote it) by name and write "
                    "CHECKPOINT with fresh moments at step 0. Identities come from IN's "
                    "metadata when present.")
    p.add_argument("source", metavar="IN", type=path_argument)
    p.add_argument("checkpoint", metavar="CHECKPOINT", type=path_argument)
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="the model, when IN has no config.json and no model identity in its "
                        "metadata (else must agree)")
    p.add_argument("--precision", choices=PRECISIONS,
                   help="the learner's precision policy (default: the metadata's, else fp32)")
    p.add_argument("--batch", type=int, metavar="B",
                   help="data identity batch when IN's metadata has none (default 1)")
    p.add_argument("--tokenizer-sha", metavar="SHA256",
                   help="data identity tokenizer digest when IN's metadata has none "
                        "(as printed by `coppelius tokenize`; default: that of IN's "
                        "tokenizer.json, else none)")
    p.add_argument("--force", action="store_true", help="replace CHECKPOINT if it exists")
    p.set_defaults(func=run_import)


def run_export(args) -> int:
    export(args.checkpoint, args.out, moments=args.moments, force=args.force,
           fmt=args.format, dtype=args.dtype, tokenizer=args.tokenizer,
           no_tokenizer=args.no_tokenizer)
    print(f"wrote {args.out}")
    return 0


def run_import(args) -> int:
    config, dropped = import_model(
        args.source, args.checkpoint, preset_name=args.preset, precision=args.precision,
        batch=args.batch, tokenizer_sha=args.tokenizer_sha, force=args.force)
    if dropped:
        print(f"{args.source}: {dropped} moment tensors not imported (fresh moments, step 0)")
    print(f"wrote {args.checkpoint}: {registry(config).total:,} parameters, step 0")
    return 0


def _refuse_existing(path: str, force: bool, what: str = "output") -> None:
    """An output must be a regular file or absent (never a FIFO or a device,
    even with --force), and absent unless --force."""
    output_target(path, what)
    if os.path.lexists(path) and not force:
        raise ExchangeError(f"{path}: exists (pass --force to replace it)")


def _refuse_read_only(path: str) -> None:
    """--force replaces a checkpoint, never a read-only one: a file without
    write permission (for anyone, so root too, whom no permission stops) is
    kept as its owner made it."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    if not st.st_mode & 0o222 or not os.access(path, os.W_OK):
        raise ExchangeError(f"{path}: is read-only (mode {stat.S_IMODE(st.st_mode):04o}); "
                            f"--force never replaces a read-only file")


# ---------------------------------------------------------------------- export

def export(checkpoint, out, moments: bool = False, force: bool = False, fmt: str = "safetensors",
           dtype: str = "float32", tokenizer=None, no_tokenizer: bool = False) -> None:
    checkpoint, out = os.fspath(checkpoint), os.fspath(out)
    if fmt not in FORMATS or dtype not in DTYPES:
        raise ExchangeError(f"--format {fmt} --dtype {dtype}: choose a format of "
                            f"{', '.join(FORMATS)} and a dtype of {', '.join(DTYPES)}")
    if fmt == "hf" and moments:
        raise ExchangeError("--moments: a Hugging Face directory holds a model, not a run's "
                            "optimizer state (use --format safetensors)")
    if moments and dtype != "float32":
        raise ExchangeError("--moments: moments export as float32 only (drop --dtype)")
    if fmt != "hf" and (tokenizer is not None or no_tokenizer):
        raise ExchangeError("--tokenizer and --no-tokenizer apply to --format hf only")
    if fmt == "hf":
        out = out.rstrip(os.sep) or out  # the directory itself, not what a link points to
        replace = hf.check_target(out, force)  # a special file or a link is never replaced
        if replace and any(same_file(checkpoint, os.path.join(out, name))
                           for name in hf.EXPORT_FILES if os.path.lexists(os.path.join(out, name))):
            raise ExchangeError(f"{out}: holds the checkpoint being exported")
    else:
        _refuse_existing(out, force)
        if os.path.exists(out) and same_file(checkpoint, out):
            raise ExchangeError(f"{out}: is the checkpoint being exported")
    with CheckpointFileSource(checkpoint) as source:
        header = source.header
        config = config_from_identity(header["model"], f"checkpoint {checkpoint}")
        if fmt == "hf":  # the one architecture that is this model (SPEC 21), else refused
            hf.architecture(config)
        files = {}
        if fmt == "hf" and not no_tokenizer:  # before the work: a missing one is refused first
            files[hf.TOKENIZER] = _run_tokenizer(checkpoint, header, config, tokenizer)
            eos = hf.tokenizer_eos(files[hf.TOKENIZER])
            files[hf.TOKENIZER_CONFIG] = hf.json_bytes(hf.tokenizer_config_json(config,
                                                                                eos and eos[0]))
        values = bind_vectors(source, config, moments=moments)  # views of the mapping
        reg = registry(config)
        names = hf.hf_names(config) if fmt == "hf" else {s.name: s.name for s in reg.specs}
        tensors = {names[s.name]: _cast(values[s.name], dtype, s.name, checkpoint)
                   for s in reg.specs}  # no alias: tied
        if moments:
            for which in ("m", "v"):
                tensors.update({moment_key(which, s.name): values[moment_key(which, s.name)]
                                for s in reg.specs})
        metadata = {key: str(header[key]) for key in METADATA_KEYS}
        if fmt == "hf":
            metadata["format"] = "pt"  # transformers loads no safetensors file without it
        body = safetensors_bytes(tensors, metadata=metadata)
        del values, tensors
    try:
        if fmt == "hf":
            files[hf.WEIGHTS] = body
            files[hf.CONFIG] = hf.json_bytes(hf.config_json(config, dtype))
            eos = hf.TOKENIZER in files and hf.tokenizer_eos(files[hf.TOKENIZER])
            files[hf.GENERATION_CONFIG] = hf.json_bytes(hf.generation_config_json(
                eos[1] if eos else None))
            hf.publish_directory(out, dict(sorted(files.items())), replace)
        else:
            publish(out, lambda f: f.write(body))
    except OSError as e:
        raise ExchangeError(f"{out}: cannot publish: {e.strerror or e}") from None


def _cast(a: np.ndarray, dtype: str, name: str, where: str) -> np.ndarray:
    """A float32 parameter as `dtype`: bfloat16 rounds as the bf16 policy's
    operands do (round_bf16), after which the conversion is exact."""
    if dtype == "float32":
        return a
    b = round_bf16(a)
    bad = ~np.isfinite(b)
    if bad.any():  # finite float32 beyond bfloat16's largest value rounds to inf
        index = np.unravel_index(np.argmax(bad), a.shape)
        raise ExchangeError(f"checkpoint {where}: {name} holds {a[index]} at "
                            f"{list(map(int, index))}, beyond bfloat16's range")
    return b.astype(ml_dtypes.bfloat16)


def _run_tokenizer(checkpoint: str, header: dict, config: Config, given) -> bytes:
    """The bytes of the tokenizer.json the checkpoint was trained with (see
    the module doc), checked to have V ids."""
    from coppelius.sample import find_tokenizer, named_tokenizer

    named = named_tokenizer(header)
    if given is None and named is None:
        raise ExchangeError(f"checkpoint {checkpoint}: names no tokenizer (tokenizer=none); "
                            f"pass --tokenizer FILE, or --no-tokenizer to export the model alone")
    path = find_tokenizer(checkpoint, header, given)
    body = hf.read_file(path, hf.MAX_TOKENIZER_BYTES, "tokenizer")
    sha = hashlib.sha256(body).hexdigest()
    if named is not None and sha != named:
        raise ExchangeError(f"tokenizer {path}: SHA-256 {sha}, but checkpoint {checkpoint} was "
                            f"trained with tokenizer={named}")
    hf.load_tokenizer_bytes(body, path, config)
    return body


# ---------------------------------------------------------------------- import

def import_model(source_path, checkpoint, preset_name: str | None = None,
                 precision: str | None = None, batch: int | None = None,
                 tokenizer_sha: str | None = None, force: bool = False):
    """Write CHECKPOINT from a safetensors file or a Hugging Face directory;
    returns (config, moment tensors dropped)."""
    source_path = os.fspath(source_path)
    if hf.is_directory(source_path):
        return import_hf(source_path, checkpoint, preset_name, precision, batch, tokenizer_sha,
                         force)
    return import_safetensors(source_path, checkpoint, preset_name, precision, batch,
                              tokenizer_sha, force)


def import_safetensors(source_path, checkpoint, preset_name: str | None = None,
                       precision: str | None = None, batch: int | None = None,
                       tokenizer_sha: str | None = None, force: bool = False):
    """Write CHECKPOINT from a safetensors file with SPEC names; returns
    (config, moment tensors dropped)."""
    source_path, checkpoint = os.fspath(source_path), os.fspath(checkpoint)
    _refuse_existing(checkpoint, force, "checkpoint")
    _refuse_read_only(checkpoint)
    if same_file(source_path, checkpoint):
        raise ExchangeError(f"{checkpoint}: is the file being imported")
    with SafetensorsSource(source_path) as source:
        meta = source.metadata
        if hf.OUTER_NAMES["tok_embedding.weight"] in source.tensors():
            raise ExchangeError(f"{source_path}: has transformers' names (model.embed_tokens."
                                f"weight): import the directory that holds it and its config.json")
        config = _import_config(meta, preset_name, source_path)
        _check_size(source, config, source_path)  # before anything is built for the claimed model
        ids = _import_identities(meta, config, precision, batch, tokenizer_sha, source_path)
        names = {name: name for name in hf.hf_names(config)}
        P, dropped = _bind_parameters(source, config, names, source_path, moments=True)
    _write_checkpoint(checkpoint, config, ids, P)
    return config, dropped


def import_hf(directory, checkpoint, preset_name: str | None = None,
              precision: str | None = None, batch: int | None = None,
              tokenizer_sha: str | None = None, force: bool = False):
    """Write CHECKPOINT from a Hugging Face directory (coppelius.hf); returns
    (config, 0)."""
    directory, checkpoint = os.fspath(directory), os.fspath(checkpoint)
    _refuse_existing(checkpoint, force, "checkpoint")
    _refuse_read_only(checkpoint)
    if any(same_file(os.path.join(directory, name), checkpoint) for name in hf.EXPORT_FILES):
        raise ExchangeError(f"{checkpoint}: is a file of the directory being imported")
    config = hf.read_config(directory)  # another architecture is refused before any tensor
    with hf.weights_source(directory) as source:
        weights = source.path
        _check_size(source, config, weights)  # before anything is built for the claimed model
        beside = hf.directory_tokenizer(directory, config)
        meta = source.metadata
        _import_config(meta, preset_name, weights, described=config)
        if tokenizer_sha is None and "data" not in meta:
            tokenizer_sha = beside
        ids = _import_identities(meta, config, precision, batch, tokenizer_sha, weights)
        P, _ = _bind_parameters(source, config, hf.hf_names(config), weights, moments=False)
    _write_checkpoint(checkpoint, config, ids, P)
    if beside is not None:  # where `sample`, `export` and `train` look for it
        publish_tokenizer(os.path.join(directory, hf.TOKENIZER), checkpoint)
    return config, 0


def _write_checkpoint(checkpoint: str, config: Config, ids: dict, P) -> None:
    """The imported checkpoint: fresh moments, step 0, written under the
    checkpoint's lock (not under a run that trains it)."""
    if os.path.isdir(os.path.dirname(os.path.abspath(checkpoint))):
        with Lock(checkpoint, "checkpoint"):
            write_checkpoint(checkpoint, config, ids, State.fresh(P), contexts=0)
    else:
        write_checkpoint(checkpoint, config, ids, State.fresh(P), contexts=0)  # says why not


def import_plan(config: Config, names: dict, tensors, moments: bool) -> tuple:
    """What import binds: (declared, bindings, offered, moment keys present).

    The parameters are declared under the file's own names (`names`: SPEC
    name -> file key), so a refusal names the tensor as the file has it; the
    tied head is an alias of its owner. bfloat16 tensors are widened by a
    cast recipe, and so are float16 ones. `offered` leaves out a stored tied head (checked bit for bit
    by _check_tied) and, with `moments`, the moment tensors (not imported)."""
    reg = registry(config)
    declared, bindings = {}, []
    for spec in reg.specs:
        key = names[spec.name]
        declared[key] = ("float32", spec.shape)
        info = tensors.get(key)
        if info is not None and info.dtype in WIDENED:  # widened exactly
            bindings.append(RecipeBind(key, Cast(Tensor(key), "float32")))
        else:
            bindings.append(Bind(key, key))
    for alias, owner in reg.aliases.items():
        declared[names[alias]] = declared[names[owner]]
        bindings.append(Alias(names[alias], names[owner]))
    moment_keys = {moment_key(which, s.name) for s in reg.specs for which in ("m", "v")} \
        if moments else set()
    tied = {names[alias] for alias in reg.aliases}
    offered = [key for key in tensors if key not in moment_keys and key not in tied]
    present = [key for key in tensors if key in moment_keys]
    return declared, bindings, offered, present


def check_binds(source, config: Config, names: dict, moments: bool) -> None:
    """Whether import would bind `source`, from its metadata alone (inspect)."""
    declared, bindings, offered, _ = import_plan(config, names, source.tensors(), moments)
    check_bindings(declared, bindings, source, offered=offered)


def _bind_parameters(source, config: Config, names: dict, where: str, moments: bool) -> tuple:
    """(P (N,) float32, moment tensors dropped) bound from `source`."""
    reg = registry(config)
    declared, bindings, offered, dropped = import_plan(config, names, source.tensors(), moments)
    for alias, owner in reg.aliases.items():
        if names[alias] in source.tensors():
            _check_tied(source, names[alias], names[owner])
    values = bind(declared, bindings, source, NumpyBackend(copy=False), offered=offered)
    for spec in reg.specs:  # the tied head equals its owner bit for bit: checked with it
        _check_finite(values[names[spec.name]], names[spec.name], where)
    P = flatten(reg, {spec.name: values[names[spec.name]] for spec in reg.specs})  # the one copy
    return P, len(dropped)


def _check_size(source, config: Config, where: str) -> None:
    """A model identity (metadata, config.json) claims a size; a file far smaller
    than that (about half its values or tensors, or fewer) is refused here,
    before a registry of, say, 10^8 layers is built for it. A file that
    falls short by a few tensors goes on to binding, which names them."""
    tensors = source.tensors()
    held = sum(math.prod(info.shape) for info in tensors.values())
    need = parameter_count(config)
    if need > 2 * held + (1 << 20) or tensor_count(config) > 2 * len(tensors) + 16:
        raise ExchangeError(f"{where}: its model ({config.identity()!r}) has {need} parameters, "
                            f"the file holds {held} values")


def _check_finite(a, name: str, where: str) -> None:
    """A checkpoint holds finite parameters: a run would only stop at its
    first step with a non-finite loss, far from the tensor that caused it."""
    bad = ~np.isfinite(a)
    if bad.any():
        index = np.unravel_index(np.argmax(bad), a.shape)  # the first in C order
        raise ExchangeError(f"{where}: tensor {name} holds a non-finite value ({a[index]}) "
                            f"at index {list(map(int, index))}")


def _check_tied(source, alias: str, owner: str) -> None:
    """A stored tied parameter (lm_head.weight) must be bit-identical to its
    owner, compared in row blocks within the source's lease bound."""
    tensors = source.tensors()
    if owner not in tensors:
        return  # binding reports the missing owner
    a, b = tensors[alias], tensors[owner]
    if (a.dtype, a.shape) != (b.dtype, b.shape):
        raise UnexpectedValue(f"{alias}: {a.dtype} {list(a.shape)} in {source.path}, but it is "
                              f"tied to {owner} ({b.dtype} {list(b.shape)})")
    rows = max(1, source.max_lease_bytes // max(a.row_bytes, 1))
    for start in range(0, a.shape[0], rows):
        block = slice(start, min(start + rows, a.shape[0]))
        x, y = source.lease(alias, block), source.lease(owner, block)
        if x.tobytes() != y.tobytes():  # bits, so -0.0 and NaN payloads count too
            raise UnexpectedValue(f"{alias}: differs from {owner} in {source.path} "
                                  f"(rows from {start}); the model ties them")


def _import_config(meta: dict, preset_name: str | None, where: str,
                   described: Config | None = None) -> Config:
    """The model: a directory's config.json (`described`), else the metadata's
    model identity, else --preset; those given must agree."""
    config = described
    if "model" in meta:
        recorded = config_from_identity(meta["model"], f"{where} metadata")
        if config is not None and recorded.identity() != config.identity():
            raise ExchangeError(f"{where}: metadata model {meta['model']!r} is not the model "
                                f"config.json describes ({config.identity()!r})")
        config = recorded
    if config is not None:
        if preset_name is not None and preset(preset_name).identity() != config.identity():
            raise ExchangeError(f"{where}: model {config.identity()!r} is not preset "
                                f"{preset_name} ({preset(preset_name).identity()!r})")
        return config
    if preset_name is None:
        raise ExchangeError(f"{where}: metadata has no model identity; pass --preset")
    return preset(preset_name)


def _fields(identity: str) -> dict:
    return dict(part.split("=", 1) for part in identity.split("|") if "=" in part)


def _import_identities(meta: dict, config: Config, precision, batch, tokenizer_sha,
                       where: str) -> dict:
    """The envelope identities of the imported checkpoint (see the module doc).
    Metadata identities are parsed and rebuilt: one that does not rebuild to
    itself, or that does not fit the model, is refused."""
    def refuse(key, why):
        return ExchangeError(f"{where}: metadata {key} {meta.get(key)!r}: {why}")

    ids = {"schema": schema_identity(config), "model": config.identity(),
           "chunk_bytes": CHUNK_BYTES}
    if "schema" in meta and meta["schema"] != ids["schema"]:
        raise refuse("schema", f"expected {ids['schema']!r} for this model")
    if "chunk_bytes" in meta and meta["chunk_bytes"] != str(CHUNK_BYTES):
        raise refuse("chunk_bytes", f"expected {CHUNK_BYTES}")

    if "learner" in meta:
        try:  # with SPEC 7's schedule and clipping parts when it has them
            hyper, have = learner_from_identity(meta["learner"], f"{where} metadata")
        except ConfigError:  # not one this version writes, or a rational out of bounds
            raise refuse("learner", "not a learner identity this version writes") from None
        ids["learner"] = hyper.identity(precision or have)
    else:
        ids["learner"] = Hyper().identity(precision or "fp32")

    if "data" in meta:
        if batch is not None or tokenizer_sha is not None:
            raise ExchangeError(f"{where}: metadata has a data identity; --batch and "
                                "--tokenizer-sha apply only to files without one")
        f = _fields(meta["data"])
        try:
            tok = None if f["tokenizer"] == "none" else f["tokenizer"]
            heldout = int(f.get("heldout", 0))  # SPEC 18: written only when K > 0
            ok = (0 < len(f["batch"]) <= 40 and int(f["batch"]) > 0
                  and len(f.get("heldout", "0")) <= 40
                  and data_identity(config, int(f["batch"]), tok, f["stream"], heldout,
                                    f.get("eval"))  # SPEC 22: a validation set's digest
                  == meta["data"])
        except (KeyError, ValueError):
            ok = False
        if not ok:
            raise refuse("data", f"not a data identity for this model (vocabulary={config.vocab}, "
                                 f"context={config.context})")
        ids["data"] = meta["data"]
    else:
        if batch is not None and batch <= 0:
            raise ExchangeError(f"--batch={batch}: must be a positive integer")
        if tokenizer_sha is not None and not SHA256.fullmatch(tokenizer_sha):
            raise ExchangeError(f"--tokenizer-sha={tokenizer_sha!r}: not a SHA-256 hex digest")
        ids["data"] = data_identity(config, batch or 1, tokenizer_sha, "none")

    if "initialization" in meta:
        f = _fields(meta["initialization"])
        try:
            seed = int(f["seed"])
            ok = initialization_identity(seed) == meta["initialization"]
        except (KeyError, ValueError):
            ok = False
        if not ok:
            raise refuse("initialization", "not an initialization identity this version writes")
        # SPEC 2 computes modulo 2^64: seed=-5 would name the generator of
        # seed=2^64-5 under a second identity, so only [0, 2^64) is a seed
        if not 0 <= seed < 2**64:
            raise refuse("initialization", f"seed {seed} is outside [0, 2**64)")
        ids["initialization"] = meta["initialization"]
    else:
        ids["initialization"] = initialization_identity(SEED)
    return ids



# ---------------------------------------------------------------------- inspect

def _describe(config: Config) -> str:
    name = hf.preset_of(config)
    return (f"{config.identity()} ({f'preset {name}, ' if name else ''}"
            f"{parameter_count(config):,} parameters)")  # counted, no registry built


def _list_tensors(source, line) -> None:
    tensors = source.tensors()
    dtypes = sorted({info.dtype for info in tensors.values()})
    values = sum(int(np.prod(info.shape)) for info in tensors.values())
    nbytes = sum(info.nbytes for info in tensors.values())
    line("tensors", f"{len(tensors)}: {values:,} values, {nbytes:,} bytes, "
                    f"{', '.join(dtypes) or 'none'}")
    width = max((len(key) for key in tensors), default=0)
    for key in sorted(tensors, key=_natural):  # layers.2 before layers.10
        info = tensors[key]
        print(f"  {key:<{width}}  {info.dtype:<8}  {list(info.shape)}")


def _natural(key: str) -> list:
    return [(0, int(part), "") if part.isdigit() else (1, 0, part)
            for part in re.split(r"(\d+)", key)]


def inspect_safetensors(path: str, line) -> None:
    """Print a safetensors file's metadata and tensors, the model its
    metadata names and whether import binds it (checked from metadata only)."""
    with SafetensorsSource(path) as source:
        meta = source.metadata
        line("safetensors", path)
        for key in sorted(meta):
            line(key, meta[key])
        _list_tensors(source, line)
        if hf.OUTER_NAMES["tok_embedding.weight"] in source.tensors():
            line("describes", "transformers' names: inspect the directory that holds it and "
                              "its config.json")
            return
        if "model" not in meta:
            line("describes", "no model recorded in the metadata (import needs --preset)")
            return
        config = _import_config(meta, None, path)
        line("describes", _describe(config))
        _check_size(source, config, path)  # before a registry is built for the claimed model
        check_binds(source, config, {name: name for name in hf.hf_names(config)}, moments=True)
        line("binds", "yes: every parameter of the model" + (" (lm_head.weight tied)"
                                                              if config.tied else ""))


def inspect_hf(directory: str, line) -> None:
    """Print a Hugging Face directory's files, tensors and the model its
    config.json describes; refuse (HfError, ExchangeError, BindingError) what
    import would refuse."""
    line("hf directory", directory)
    line("files", ", ".join(sorted(os.listdir(directory))) or "none")
    config = hf.read_config(directory)
    arch = hf.architecture(config)
    line("architecture", f"{arch.name} (model_type {arch.model_type})")
    line("describes", _describe(config))
    with hf.weights_source(directory) as source:
        weights = source.path
        meta = source.metadata
        for key in sorted(meta):
            line(key, meta[key])
        _list_tensors(source, line)
        _import_config(meta, None, weights, described=config)
        _check_size(source, config, weights)  # before a registry is built for the claimed model
        check_binds(source, config, hf.hf_names(config), moments=False)
    sha = hf.directory_tokenizer(directory, config)
    line("tokenizer", f"{hf.TOKENIZER}: {config.vocab} ids, sha256 {sha}" if sha else
         "none (AutoTokenizer will not load this directory)")
    line("binds", "yes: every parameter of the model" + (
        " (lm_head.weight tied to model.embed_tokens.weight)" if config.tied else ""))
