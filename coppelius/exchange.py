"""`coppelius export` and `coppelius import`: checkpoints to and from
safetensors files.

export CHECKPOINT OUT.safetensors [--moments]
    The parameters under their SPEC names (section 2) as float32, without
    `lm_head.weight` (tied to `tok_embedding.weight`, so not stored); with
    --moments also `m/<name>` and `v/<name>`. The metadata (str -> str) holds
    the checkpoint's identities (schema, model, learner, data,
    initialization, chunk_bytes) and its step and contexts.

import IN.safetensors CHECKPOINT [--preset NAME] [--precision fp32|bf16]
    Binds the file's tensors by name through the binding layer (SPEC 12)
    and writes a checkpoint that starts a run afresh: step 0, contexts 0,
    zero moments (moments in the file are not carried over; AdamW's bias
    correction restarts at step 1 with them zero). bfloat16 tensors are
    widened to float32 exactly. A `lm_head.weight` in the file must equal
    `tok_embedding.weight` bit for bit (the model ties them).

    Identities come from the file's metadata when it has them (a file that
    `export` wrote); otherwise, documented defaults:
      model           the --preset's
      learner         the default AdamW hyperparameters, precision --precision (fp32)
      data            batch --batch (1), tokenizer --tokenizer-sha (none), stream=none:
                      train on it with `coppelius train --new-data`, which lifts
                      only the stream part
      initialization  seed 20260925 (the values are the file's; the identity names
                      the generator a fresh run of this model would use)
    --precision given with a metadata learner identity replaces only its precision.

Both publish atomically (a temporary in the same directory, fsync, rename)
and refuse to replace an existing file unless --force.
"""

from __future__ import annotations

import math
import os
import re

import numpy as np
from safetensors.numpy import save as safetensors_bytes

from coppelius.reference.binding import (Alias, Bind, Cast, NumpyBackend, RecipeBind, Tensor, UnexpectedValue,
                               bind, bind_vectors, flatten)
from coppelius.reference.checkpoint import CHUNK_BYTES, IDENTITY_KEYS, write_checkpoint
from coppelius.reference.config import (PRECISIONS, PRESETS, SEED, Config, config_from_identity, Hyper, data_identity,
                              initialization_identity, parameter_count, parse_rational, preset,
                              schema_identity, tensor_count)
from coppelius.reference.errors import CoppeliusError
from coppelius.reference.fsutil import Lock, output_target, path_argument, publish, same_file
from coppelius.reference.params import registry
from coppelius.reference.sources import CheckpointFileSource, SafetensorsSource, moment_key
from coppelius.reference.state import State

METADATA_KEYS = IDENTITY_KEYS + ("step", "contexts")
SHA256 = re.compile(r"[0-9a-f]{64}")


class ExchangeError(CoppeliusError):
    """A file cannot be exported or imported as asked (names the file and field)."""


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "export", help="write a checkpoint's parameters to a safetensors file",
        description="Write the parameters of CHECKPOINT (float32, SPEC names, no tied "
                    "lm_head.weight) to OUT with the checkpoint's identities, step and "
                    "contexts as metadata.")
    p.add_argument("checkpoint", metavar="CHECKPOINT", type=path_argument)
    p.add_argument("out", metavar="OUT.safetensors", type=path_argument)
    p.add_argument("--moments", action="store_true",
                   help="also write the AdamW moments as m/<name> and v/<name>")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.set_defaults(func=run_export)

    p = subparsers.add_parser(
        "import", help="make a checkpoint from a safetensors file",
        description="Bind the tensors of IN by their SPEC names and write CHECKPOINT with "
                    "fresh moments at step 0. Identities come from IN's metadata when present.")
    p.add_argument("source", metavar="IN.safetensors", type=path_argument)
    p.add_argument("checkpoint", metavar="CHECKPOINT", type=path_argument)
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="the model, when IN's metadata has no model identity (else must agree)")
    p.add_argument("--precision", choices=PRECISIONS,
                   help="the learner's precision policy (default: the metadata's, else fp32)")
    p.add_argument("--batch", type=int, metavar="B",
                   help="data identity batch when IN's metadata has none (default 1)")
    p.add_argument("--tokenizer-sha", metavar="SHA256",
                   help="data identity tokenizer digest when IN's metadata has none "
                        "(as printed by `coppelius tokenize`; default none)")
    p.add_argument("--force", action="store_true", help="replace CHECKPOINT if it exists")
    p.set_defaults(func=run_import)


def run_export(args) -> int:
    export(args.checkpoint, args.out, moments=args.moments, force=args.force)
    print(f"wrote {args.out}")
    return 0


def run_import(args) -> int:
    config, dropped = import_safetensors(
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


# ---------------------------------------------------------------------- export

def export(checkpoint, out, moments: bool = False, force: bool = False) -> None:
    checkpoint, out = os.fspath(checkpoint), os.fspath(out)
    _refuse_existing(out, force)
    if os.path.exists(out) and same_file(checkpoint, out):
        raise ExchangeError(f"{out}: is the checkpoint being exported")
    with CheckpointFileSource(checkpoint) as source:
        header = source.header
        config = config_from_identity(header["model"], f"checkpoint {checkpoint}")
        values = bind_vectors(source, config, moments=moments)  # views of the mapping
        reg = registry(config)
        tensors = {spec.name: values[spec.name] for spec in reg.specs}  # no alias: tied
        if moments:
            for which in ("m", "v"):
                tensors.update({moment_key(which, s.name): values[moment_key(which, s.name)]
                                for s in reg.specs})
        metadata = {key: str(header[key]) for key in METADATA_KEYS}
        body = safetensors_bytes(tensors, metadata=metadata)
        del values, tensors
    try:
        publish(out, lambda f: f.write(body))
    except OSError as e:
        raise ExchangeError(f"{out}: cannot publish: {e.strerror or e}") from None


# ---------------------------------------------------------------------- import

def import_safetensors(source_path, checkpoint, preset_name: str | None = None,
                       precision: str | None = None, batch: int | None = None,
                       tokenizer_sha: str | None = None, force: bool = False):
    """Write CHECKPOINT from a safetensors file; returns (config, moment
    tensors dropped)."""
    source_path, checkpoint = os.fspath(source_path), os.fspath(checkpoint)
    _refuse_existing(checkpoint, force, "checkpoint")
    if same_file(source_path, checkpoint):
        raise ExchangeError(f"{checkpoint}: is the file being imported")
    with SafetensorsSource(source_path) as source:
        where = source_path
        meta = source.metadata
        config = _import_config(meta, preset_name, where)
        _check_size(source, config, where)  # before anything is built for the claimed model
        ids = _import_identities(meta, config, precision, batch, tokenizer_sha, where)
        reg = registry(config)
        tensors = source.tensors()
        moments = {moment_key(which, s.name) for s in reg.specs for which in ("m", "v")}
        dropped = sum(1 for key in tensors if key in moments)
        for alias, owner in reg.aliases.items():
            if alias in tensors:
                _check_tied(source, alias, owner)
        offered = [key for key in tensors if key not in moments and key not in reg.aliases]
        bindings = []
        for spec in reg.specs:
            info = tensors.get(spec.name)
            if info is not None and info.dtype == "bfloat16":  # widened exactly
                bindings.append(RecipeBind(spec.name, Cast(Tensor(spec.name), "float32")))
            else:
                bindings.append(Bind(spec.name, spec.name))
        bindings += [Alias(alias, owner) for alias, owner in reg.aliases.items()]
        values = bind(reg, bindings, source, NumpyBackend(copy=False), offered=offered)
        for spec in reg.specs:  # the tied head equals its owner bit for bit: checked with it
            _check_finite(values[spec.name], spec.name, where)
        P = flatten(reg, values)  # the one copy
    if os.path.isdir(os.path.dirname(os.path.abspath(checkpoint))):
        with Lock(checkpoint, "checkpoint"):  # not under a run that trains it
            write_checkpoint(checkpoint, config, ids, State.fresh(P), contexts=0)
    else:
        write_checkpoint(checkpoint, config, ids, State.fresh(P), contexts=0)  # says why not
    return config, dropped


def _check_size(source, config: Config, where: str) -> None:
    """A model identity in the metadata claims a size; a file far smaller
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


def _import_config(meta: dict, preset_name: str | None, where: str) -> Config:
    if "model" in meta:
        config = config_from_identity(meta["model"], f"{where} metadata")
        if preset_name is not None and preset(preset_name).identity() != config.identity():
            raise ExchangeError(f"{where}: metadata model {meta['model']!r} is not preset "
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
        f = _fields(meta["learner"])
        try:
            hyper = Hyper(**{k: parse_rational(f[k], k) for k in
                             ("lr", "beta1", "beta2", "weight_decay", "epsilon")})
            have = f["precision"]
            ok = hyper.identity(have) == meta["learner"]
        except (KeyError, ValueError, ZeroDivisionError, CoppeliusError):
            ok = False
        if not ok:
            raise refuse("learner", "not a learner identity this version writes")
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
            ok = int(f["batch"]) > 0 and len(f["batch"]) <= 40 and data_identity(
                config, int(f["batch"]), tok, f["stream"]) == meta["data"]
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

