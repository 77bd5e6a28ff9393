"""Binding (SPEC section 12): a model's parameters get their values from a
checkpoint source by stable parameter identity (the names of SPEC section 2).

A binding names a runtime parameter and says where its value comes from:

    Bind(param, key, rows=None)   a source tensor, or a range of its rows
    Alias(param, of)              the very same storage as another binding
    RecipeBind(param, recipe)     an expression over source tensors

Recipes are small dataclasses: Tensor(key), Slice(x, axis, start, stop),
Concat(xs, axis), Transpose(x), Cast(x, dtype). Each infers its dtype, shape
and byte length from the source's metadata alone (`infer`), and computes its
value on a backend (`realize`). A backend that fuses q, k, v into one (3D, D)
weight binds it as

    RecipeBind("layers.0.attn.qkv.weight", Concat((Tensor("layers.0.attn.q.weight"),
               Tensor("layers.0.attn.k.weight"), Tensor("layers.0.attn.v.weight")), 0))

`bind` visits every parameter of the model and fails closed: nothing is read
until every binding validates, and each failure is its own error type naming
the parameter. Order of the checks: names, duplicates, bindings the model
does not take, parameters with no binding, then per binding the inferred
byte length, shape and dtype against the declared ones, then source tensors
no binding reads; only then are values realized and aliases shared. A
backend's own exception while realizing (an upload, a device operation)
becomes a BackendFailure naming the parameter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from .config import Config
from .params import Registry, registry
from .sources import (DTYPES, BindingError, CheckpointFileSource, SourceError, TensorInfo,
                      moment_key, tensor_info)
from .state import State

__all__ = [
    "BindingError", "MissingValue", "UnexpectedValue", "DuplicateBinding", "InvalidName",
    "ByteLengthMismatch", "ShapeMismatch", "DtypeMismatch", "SourceError", "RecipeError",
    "BackendFailure",
    "Bind", "Alias", "RecipeBind", "Tensor", "Slice", "Concat", "Transpose", "Cast",
    "NumpyBackend", "declared_parameters", "default_bindings", "materialize", "bind", "check_bindings",
    "bind_vectors", "flatten", "load_state", "state_from_source",
]


# ---------------------------------------------------------------------- errors
# BindingError (a CoppeliusError, exit status 2) and SourceError live in
# sources.py, the lowest layer; the rest of the family is here.

class MissingValue(BindingError):
    """A parameter of the model has no value (no binding, or its key is absent)."""


class UnexpectedValue(BindingError):
    """A value no parameter takes: a binding of a name the model does not have,
    or a source tensor no binding reads."""


class DuplicateBinding(BindingError):
    """Two bindings of one parameter name."""


class InvalidName(BindingError):
    """A binding's parameter name (or source key) is not a valid identity."""


class ByteLengthMismatch(BindingError):
    """A value's byte length differs from the parameter's declared one."""


class ShapeMismatch(BindingError):
    """A value's shape differs from the parameter's declared one."""


class DtypeMismatch(BindingError):
    """A value's dtype differs from the parameter's declared one (same bytes, same shape)."""


class RecipeError(BindingError):
    """A recipe that cannot be evaluated on the source's metadata (bad axis,
    range, concatenation or cast)."""


class BackendFailure(BindingError):
    """The backend itself failed while realizing a value that passed every
    check (an upload, a device allocation, a slice, concatenation or cast
    raising its own exception): names the parameter, the backend and the
    backend's error."""


# A parameter identity: dotted lowercase segments, as in SPEC section 2
# (`tok_embedding.weight`, `layers.3.mlp.up.weight`).
NAME = re.compile(r"[a-z_][a-z0-9_]*(\.[a-z0-9_]+)*")
CAST_DTYPES = ("float32", "bfloat16")
FLOAT_DTYPES = ("float64", "float32", "float16", "bfloat16")


def _named(param: str, error: BindingError) -> BindingError:
    """The same error type, its message prefixed with the parameter name."""
    return type(error)(f"{param}: {error}")


# --------------------------------------------------------------------- backend

class NumpyBackend:
    """The backend protocol, on the host. CuPy and MLX implement the same
    methods on their arrays: `from_host` uploads a lease (a fresh, owned,
    contiguous array), the others compute on the backend's arrays, and
    `alias` returns the very same object (tied storage, no copy).

    `copy=False` is for staging on the host only (load_state, export): a
    value that needs no conversion stays a read-only view of its lease, so
    the one copy made is the caller's (into the flat vector, or the file)."""

    name = "numpy"

    def __init__(self, copy: bool = True):
        self.copy = copy

    def from_host(self, array: np.ndarray, dtype: str) -> np.ndarray:
        if not self.copy:
            return np.ascontiguousarray(array, dtype=DTYPES[dtype])
        return np.array(array, dtype=DTYPES[dtype], order="C", copy=True)

    def slice(self, x, axis: int, start: int, stop: int):
        index = (slice(None),) * axis + (slice(start, stop),)
        return np.ascontiguousarray(x[index])

    def concat(self, xs, axis: int):
        return np.concatenate(xs, axis=axis)

    def transpose(self, x):
        return np.ascontiguousarray(x.T)

    def cast(self, x, dtype: str):
        return x.astype(DTYPES[dtype])  # float32 -> bfloat16 rounds to nearest even (ml_dtypes)

    def alias(self, x):
        return x


# --------------------------------------------------------------------- recipes

@dataclass(frozen=True)
class Tensor:
    """A source tensor; `rows` (a slice of the first axis) leases only those rows."""

    key: str
    rows: slice | None = None

    def keys(self):
        return [self.key]

    def infer(self, source) -> TensorInfo:
        if self.key not in source.tensors():
            raise MissingValue(f"source {source.path} has no tensor {self.key!r}")
        return source.check_lease(self.key, self.rows)

    def realize(self, source, backend):
        lease = source.lease(self.key, self.rows)
        return backend.from_host(lease, str(lease.dtype))


@dataclass(frozen=True)
class Slice:
    """x[start:stop] along `axis`."""

    x: object
    axis: int
    start: int
    stop: int

    def keys(self):
        return self.x.keys()

    def _rows(self):
        # A row range of a whole source tensor is leased as just those rows,
        # so the source's bound applies to the rows, not the whole tensor.
        if isinstance(self.x, Tensor) and self.x.rows is None and self.axis == 0:
            return Tensor(self.x.key, slice(self.start, self.stop))
        return None

    def infer(self, source) -> TensorInfo:
        info = self.x.infer(source) if self._rows() is None else _whole(self.x, source)
        ndim = len(info.shape)
        if not (isinstance(self.axis, int) and 0 <= self.axis < ndim):
            raise RecipeError(f"slice axis {self.axis!r} of a {ndim}-dimensional value")
        n = info.shape[self.axis]
        if not (isinstance(self.start, int) and isinstance(self.stop, int)
                and 0 <= self.start <= self.stop <= n):
            raise RecipeError(f"slice {self.start!r}:{self.stop!r} outside 0:{n} on axis {self.axis}")
        if self._rows() is not None:
            return self._rows().infer(source)
        shape = info.shape[:self.axis] + (self.stop - self.start,) + info.shape[self.axis + 1:]
        return tensor_info(info.dtype, shape)

    def realize(self, source, backend):
        if self._rows() is not None:
            return self._rows().realize(source, backend)
        return backend.slice(self.x.realize(source, backend), self.axis, self.start, self.stop)


def _whole(tensor: Tensor, source) -> TensorInfo:
    """A source tensor's metadata without the lease bound (it is leased in part)."""
    if tensor.key not in source.tensors():
        raise MissingValue(f"source {source.path} has no tensor {tensor.key!r}")
    return source.tensors()[tensor.key]


@dataclass(frozen=True)
class Concat:
    """xs joined along `axis`: same dtype, same size on every other axis."""

    xs: tuple
    axis: int

    def keys(self):
        return [key for x in self.xs for key in x.keys()]

    def infer(self, source) -> TensorInfo:
        if not self.xs:
            raise RecipeError("concat of nothing")
        infos = [x.infer(source) for x in self.xs]
        first = infos[0]
        ndim = len(first.shape)
        if not (isinstance(self.axis, int) and 0 <= self.axis < ndim):
            raise RecipeError(f"concat axis {self.axis!r} of {ndim}-dimensional values")
        for info in infos[1:]:
            if info.dtype != first.dtype:
                raise RecipeError(f"concat of {first.dtype} and {info.dtype}")
            other = list(info.shape)
            if len(other) != ndim or other[:self.axis] + other[self.axis + 1:] != \
                    list(first.shape[:self.axis] + first.shape[self.axis + 1:]):
                raise RecipeError(f"concat on axis {self.axis} of shapes "
                                  f"{first.shape} and {info.shape}")
        length = sum(info.shape[self.axis] for info in infos)
        shape = first.shape[:self.axis] + (length,) + first.shape[self.axis + 1:]
        return tensor_info(first.dtype, shape)

    def realize(self, source, backend):
        return backend.concat([x.realize(source, backend) for x in self.xs], self.axis)


@dataclass(frozen=True)
class Transpose:
    """x.T of a two-dimensional x (a Linear weight (out, in) -> (in, out))."""

    x: object

    def keys(self):
        return self.x.keys()

    def infer(self, source) -> TensorInfo:
        info = self.x.infer(source)
        if len(info.shape) != 2:
            raise RecipeError(f"transpose of a {len(info.shape)}-dimensional value "
                              f"{info.shape} (two dimensions needed)")
        return tensor_info(info.dtype, info.shape[::-1])

    def realize(self, source, backend):
        return backend.transpose(self.x.realize(source, backend))


@dataclass(frozen=True)
class Cast:
    """x converted to `dtype` ("float32" or "bfloat16"; to bfloat16 rounds
    to nearest even, to float32 is exact from bfloat16)."""

    x: object
    dtype: str

    def keys(self):
        return self.x.keys()

    def infer(self, source) -> TensorInfo:
        info = self.x.infer(source)
        if self.dtype not in CAST_DTYPES:
            raise RecipeError(f"cast to {self.dtype!r} (choose from {', '.join(CAST_DTYPES)})")
        if info.dtype not in FLOAT_DTYPES:
            raise RecipeError(f"cast of a {info.dtype} value (floating point needed)")
        return tensor_info(self.dtype, info.shape)

    def realize(self, source, backend):
        return backend.cast(self.x.realize(source, backend), self.dtype)


RECIPES = (Tensor, Slice, Concat, Transpose, Cast)


# -------------------------------------------------------------------- bindings

@dataclass(frozen=True)
class Bind:
    """`param` takes source tensor `key`, or its rows `rows` (a slice)."""

    param: str
    key: str
    rows: slice | None = None

    @property
    def recipe(self):
        return Tensor(self.key, self.rows)


@dataclass(frozen=True)
class Alias:
    """`param` shares the storage of the parameter `of` (no copy)."""

    param: str
    of: str


@dataclass(frozen=True)
class RecipeBind:
    """`param` takes the value of `recipe`."""

    param: str
    recipe: object


def declared_parameters(model) -> dict:
    """{name: (dtype, shape)} of a model: a Config or Registry (every
    parameter float32, aliases included), or such a dict itself."""
    if isinstance(model, Config):
        model = registry(model)
    if isinstance(model, Registry):
        declared = {spec.name: ("float32", tuple(spec.shape)) for spec in model.specs}
        for alias, owner in model.aliases.items():
            declared[alias] = declared[owner]
        return declared
    declared = {}
    for name, (dtype, shape) in model.items():
        if dtype not in DTYPES:
            raise BindingError(f"{name}: declared dtype {dtype!r} unknown ({', '.join(DTYPES)})")
        declared[name] = (dtype, tuple(shape))
    return declared


def default_bindings(config: Config) -> list:
    """Every parameter bound by its own name; the tied head shares the embedding."""
    reg = registry(config)
    bindings = [Bind(spec.name, spec.name) for spec in reg.specs]
    bindings += [Alias(alias, owner) for alias, owner in reg.aliases.items()]
    return bindings


# ------------------------------------------------------------- materialization

def _check_declared(param: str, info: TensorInfo, declared: tuple) -> None:
    """Byte length first (SPEC 12), then shape, then dtype."""
    dtype, shape = declared
    want = tensor_info(dtype, shape)
    have = f"{info.dtype} {list(info.shape)}"
    takes = f"{dtype} {list(shape)}"
    if info.nbytes != want.nbytes:
        raise ByteLengthMismatch(f"{param}: value is {info.nbytes} bytes ({have}), "
                                 f"the parameter takes {want.nbytes} bytes ({takes})")
    if tuple(info.shape) != tuple(shape):
        raise ShapeMismatch(f"{param}: value has shape {list(info.shape)}, "
                            f"the parameter takes {list(shape)}")
    if info.dtype != dtype:
        raise DtypeMismatch(f"{param}: value is {info.dtype}, the parameter takes {dtype}")


def _plan(source, bindings: list, declared: dict) -> tuple:
    """Infer and check every binding against `declared` from metadata alone.
    Returns (owners, aliases): owners [(param, recipe)], aliases [(param, of)]."""
    owners, aliases = [], []
    for b in bindings:
        if b.param not in declared:
            raise UnexpectedValue(f"{b.param}: the model has no such parameter")
        if isinstance(b, Alias):
            aliases.append((b.param, b.of))
            continue
        recipe = b.recipe
        _check_recipe(b.param, recipe)
        try:
            info = recipe.infer(source)
        except BindingError as e:
            raise _named(b.param, e) from None
        _check_declared(b.param, info, declared[b.param])
        owners.append((b.param, recipe))
    owned = {param: recipe for param, recipe in owners}
    for param, of in aliases:
        if of not in owned:
            if any(of == a for a, _ in aliases):
                raise RecipeError(f"{param}: alias of {of!r}, itself an alias (alias its owner)")
            raise MissingValue(f"{param}: alias of {of!r}, which no binding gives a value")
        if tuple(declared[param]) != tuple(declared[of]):
            _check_declared(param, tensor_info(*declared[of]), declared[param])
    return owners, aliases


def _backend_failure(param: str, backend, error: Exception) -> BackendFailure:
    # the backend's own message, first line only: a device library's error
    # may span lines, and a binding error is shown as one line
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    name = getattr(backend, "name", type(backend).__name__)
    return BackendFailure(f"{param}: backend {name} failed to realize the value: "
                          f"{type(error).__name__}{': ' + text if text else ''}")


def _realize(source, backend, owners: list, aliases: list) -> dict:
    values = {}
    for param, recipe in owners:
        try:
            values[param] = recipe.realize(source, backend)
        except BindingError as e:
            raise _named(param, e) from None
        except Exception as e:  # the backend's own failure (out of memory, a device error)
            raise _backend_failure(param, backend, e) from e
    for param, of in aliases:
        try:
            values[param] = backend.alias(values[of])  # the same object: tied storage
        except Exception as e:
            raise _backend_failure(param, backend, e) from e
    return values


def materialize(source, bindings, backend, declared: dict) -> dict:
    """{param: array}: check every inferred (dtype, shape, byte length)
    against `declared` {param: (dtype, shape)}, then realize each owner, then
    share aliases. Raises a BindingError before anything is read if any check fails."""
    owners, aliases = _plan(source, list(bindings), declared_parameters(declared))
    return _realize(source, backend, owners, aliases)


def _check_names(bindings: list) -> None:
    for b in bindings:
        if not isinstance(b, (Bind, Alias, RecipeBind)):
            raise RecipeError(f"{b!r}: not a binding (Bind, Alias or RecipeBind)")
        names = [b.param] + ([b.of] if isinstance(b, Alias) else [])
        for name in names:
            if not (isinstance(name, str) and NAME.fullmatch(name)):
                raise InvalidName(f"{name!r}: not a parameter name (dotted lowercase "
                                  "segments, e.g. layers.0.attn.q.weight)")
        if not isinstance(b, Alias):
            _check_recipe(b.param, b.recipe)


def _check_recipe(param: str, recipe) -> None:
    """Every node a recipe, every source key a printable non-empty string."""
    if not isinstance(recipe, RECIPES):
        raise RecipeError(f"{param}: {recipe!r} is not a recipe "
                          f"({', '.join(r.__name__ for r in RECIPES)})")
    if isinstance(recipe, Tensor):
        if not (isinstance(recipe.key, str) and recipe.key and recipe.key.isprintable()):
            raise InvalidName(f"{param}: source key {recipe.key!r} is not a name")
        return
    children = recipe.xs if isinstance(recipe, Concat) else (recipe.x,)
    if not isinstance(children, (tuple, list)):
        raise RecipeError(f"{param}: concat of {children!r}, not a tuple of recipes")
    for child in children:
        _check_recipe(param, child)


def bind(model, bindings, source, backend, offered=None) -> dict:
    """Bind every parameter of `model` (a Config, a Registry, or
    {name: (dtype, shape)}) from `source`; returns {param: array}.

    `offered`: the source keys meant for this model (default: all of the
    source's); one that no binding reads is an UnexpectedValue.
    """
    owners, aliases = _validate(model, bindings, source, offered)
    return _realize(source, backend, owners, aliases)


def check_bindings(model, bindings, source, offered=None) -> None:
    """Every check `bind` makes, from the source's metadata alone: nothing
    is leased (`coppelius inspect` says whether a file binds without reading it)."""
    _validate(model, bindings, source, offered)


def _validate(model, bindings, source, offered) -> tuple:
    declared = declared_parameters(model)
    bindings = list(bindings)
    _check_names(bindings)
    seen = set()
    for b in bindings:
        if b.param in seen:
            raise DuplicateBinding(f"{b.param}: bound twice")
        seen.add(b.param)
    for b in bindings:
        if b.param not in declared:
            raise UnexpectedValue(f"{b.param}: the model has no such parameter")
    for name in declared:
        if name not in seen:
            raise MissingValue(f"{name}: no binding gives it a value")
    _check_keys(source, bindings, offered)
    owners, aliases = _plan(source, bindings, declared)
    return owners, aliases


def _listed(keys: list, most: int = 8) -> str:
    shown = ", ".join(repr(k) for k in keys[:most])
    return shown + (f" and {len(keys) - most} more" if len(keys) > most else "")


def _check_keys(source, bindings: list, offered) -> None:
    """Every key the bindings read exists in the source, and every offered
    key is read: otherwise one error that lists every missing and every
    unexpected key (a renamed tensor shows as both), not the first alone."""
    read = {key for b in bindings if not isinstance(b, Alias) for key in b.recipe.keys()}
    tensors = source.tensors()
    missing = sorted(key for key in read if key not in tensors)
    unexpected = [key for key in (tensors if offered is None else offered) if key not in read]
    if not missing and not unexpected:
        return
    parts = []
    if missing:
        parts.append(f"missing tensor{'s' * (len(missing) > 1)} {_listed(missing)}")
    if unexpected:
        parts.append(f"unexpected tensor{'s' * (len(unexpected) > 1)} {_listed(unexpected)} "
                     "(no parameter takes them)")
    error = MissingValue if missing else UnexpectedValue
    raise error(f"source {source.path}: " + "; ".join(parts))


# ------------------------------------------------------------ checkpoint state

def flatten(reg: Registry, values: dict) -> np.ndarray:
    """(N,) float32: the bound tensors in canonical order (SPEC 2)."""
    flat = np.empty(reg.total, dtype=np.float32)
    for spec in reg.specs:
        flat[spec.slice] = values[spec.name].reshape(-1)
    return flat


def bind_vectors(source: CheckpointFileSource, config: Config, moments: bool = True) -> dict:
    """{name: array} of P (default bindings, lm_head.weight tied), and with
    `moments` also {"m/<name>": ..., "v/<name>": ...}, bound by name from a
    checkpoint file whatever order the file lists its parameters in. The
    arrays are read-only views of the source's mapping: copy before closing it."""
    reg = registry(config)
    backend = NumpyBackend(copy=False)  # views of the mapped file; the caller copies once
    # every tensor of the file that is not a moment is offered to the model,
    # so a foreign or renamed parameter is named, not silently skipped
    values = bind(reg, default_bindings(config), source, backend,
                  offered=[key for key in source.tensors() if not key.startswith(("m/", "v/"))])
    if moments:
        owners = {spec.name: ("float32", spec.shape) for spec in reg.specs}  # moments: no alias
        for which in ("m", "v"):
            part = bind(owners, [Bind(name, moment_key(which, name)) for name in owners],
                        source, backend,
                        offered=[key for key in source.tensors() if key.startswith(which + "/")])
            values.update({moment_key(which, name): a for name, a in part.items()})
    return values


def load_state(path, config: Config, expect: dict | None = None, new_data: bool = False,
               new_learner: bool = False):
    """The one way a checkpoint's P, M and V become arrays: the file is
    validated, its identities compared with `expect` (the run's, as by
    read_checkpoint), and every parameter bound by name through the binding
    layer. Returns a reference.checkpoint.Checkpoint."""
    with CheckpointFileSource(path) as source:
        return state_from_source(source, config, expect, new_data, new_learner)


def state_from_source(source: CheckpointFileSource, config: Config, expect: dict | None = None,
                      new_data: bool = False, new_learner: bool = False):
    """load_state on a source already open (and so already validated): a
    caller that reads the header first to learn the model validates the
    file once, not twice."""
    from .checkpoint import Checkpoint, check_identities

    header = source.header
    if expect is not None:
        check_identities(header, source.path, expect, new_data, new_learner)
    values = bind_vectors(source, config, moments=True)
    reg = registry(config)
    P = flatten(reg, values)
    M = flatten(reg, {name: values[moment_key("m", name)] for name in reg.by_name})
    V = flatten(reg, {name: values[moment_key("v", name)] for name in reg.by_name})
    del values
    step = header["step"]
    state = State(P=P, M=M, V=V, t=step)
    return Checkpoint(info=source.info, header=header, state=state, step=step,
                      contexts=header["contexts"])
