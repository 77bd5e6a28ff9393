"""The layouts the backends compute with, from the registry (SPEC 2, 21).

A backend fuses the products that read one input: q, k and v are one
product with the (q | k | v) rows of its weight side by side, gate and up
another. Which columns of the fused output hold q, k or v, how wide each is,
and where each parameter sits in P are numbers of this one object, computed
from the registry and passed to launchers and kernels as values, so a model
family (grouped k/v heads, a norm without bias) changes numbers, not code.

    qkv row:     [ q: H E | k: Hkv E | v: Hkv E ]      (BT, qkv_width)
    gate_up row: [ gate: F | up: F ]                   (BT, 2F)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .config import Config
from .errors import ConfigError
from .params import registry


@dataclass(frozen=True)
class Columns:
    """A block of columns in the rows of a fused product's output."""

    start: int
    width: int

    @property
    def stop(self) -> int:
        return self.start + self.width


@dataclass(frozen=True)
class LayerOffsets:
    """Offsets into P (and G) of one layer's parameters, in elements."""

    attn_norm: int  # attn_norm.weight (D,); its bias, where it has one, right after
    qkv: int  # q, k, v weights, adjacent: one (qkv_width, D) matrix
    o: int  # (D, D)
    mlp_norm: int  # mlp_norm.weight (D,); its bias right after
    gate_up: int  # gate, up weights, adjacent: one (2F, D) matrix
    down: int  # (D, F)


@dataclass(frozen=True)
class Layout:
    """The fused layouts and parameter offsets of one configuration."""

    heads: int  # H
    kv_heads: int  # Hkv
    head_dim: int  # E
    rotary_dim: int  # R: the rotated elements of each head (E unless rotary < 1)
    q: Columns  # in the qkv row
    k: Columns
    v: Columns
    gate: Columns  # in the gate_up row
    up: Columns
    norm_bias: bool  # each norm's bias follows its weight in P (layernorm); rmsnorm has none
    layers: tuple  # LayerOffsets, one per layer
    final_norm: int  # final_norm.weight's offset

    @property
    def qkv_width(self) -> int:  # the fused q/k/v product's output width
        return self.v.stop

    @property
    def qk_width(self) -> int:  # q and k side by side: what rope rotates
        return self.k.stop

    @property
    def gate_up_width(self) -> int:  # 2F
        return self.up.stop

    @property
    def norm_params(self) -> int:  # the elements of one norm: weight, and bias where it has one
        return (2 if self.norm_bias else 1) * self.q.width


def qkv_columns(heads: int, kv_heads: int, head_dim: int) -> tuple:
    """(q, k, v) Columns of the fused q/k/v row: q's H heads, then k's and
    v's Hkv heads each, E columns a head. The one place this arithmetic is
    written; a consumer that has no Config (a cuDNN graph keyed by its
    shape, a launcher given arrays) calls it with the heads it has."""
    q, kv = heads * head_dim, kv_heads * head_dim
    return Columns(0, q), Columns(q, kv), Columns(q + kv, kv)


@functools.lru_cache(maxsize=None)
def layout(config: Config) -> Layout:
    """The layout of `config`, from its registry. Checks the adjacency the
    fused products rely on and names the parameter where it fails."""
    reg = registry(config)

    def rows(name):
        return reg[name].shape[0]

    columns = qkv_columns(config.n_head, config.kv_heads, config.head_dim)
    q, k, v = (c.width for c in columns)
    gate = config.d_ff
    for l in range(config.n_layer):  # the registry's rows are the columns' widths
        for part, width in zip("qkv", (q, k, v)):
            assert rows(f"layers.{l}.attn.{part}.weight") == width, (l, part)
        assert rows(f"layers.{l}.mlp.gate.weight") == rows(f"layers.{l}.mlp.up.weight") == gate
    D = config.d_model
    layers = tuple(_layer_offsets(reg, l, D, (q, k, v), gate, config.norm_bias)
                   for l in range(config.n_layer))
    final = reg["final_norm.weight"].offset
    if config.norm_bias:
        _adjacent(reg, "final_norm.bias", final + D)
    return Layout(heads=config.n_head, kv_heads=config.kv_heads, head_dim=config.head_dim,
                  rotary_dim=config.rotary_dim, q=columns[0], k=columns[1], v=columns[2],
                  gate=Columns(0, gate), up=Columns(gate, gate),
                  norm_bias=config.norm_bias, layers=layers, final_norm=final)


def _layer_offsets(reg, l: int, D: int, qkv: tuple, F: int, norm_bias: bool) -> LayerOffsets:
    p = f"layers.{l}."
    offset = {name: reg[p + name].offset for name in (
        "attn_norm.weight", "attn.q.weight", "attn.o.weight", "mlp_norm.weight",
        "mlp.gate.weight", "mlp.down.weight")}
    q = offset["attn.q.weight"]
    _adjacent(reg, p + "attn.k.weight", q + qkv[0] * D)
    _adjacent(reg, p + "attn.v.weight", q + (qkv[0] + qkv[1]) * D)
    _adjacent(reg, p + "mlp.up.weight", offset["mlp.gate.weight"] + F * D)
    if norm_bias:
        _adjacent(reg, p + "attn_norm.bias", offset["attn_norm.weight"] + D)
        _adjacent(reg, p + "mlp_norm.bias", offset["mlp_norm.weight"] + D)
    return LayerOffsets(offset["attn_norm.weight"], q, offset["attn.o.weight"],
                        offset["mlp_norm.weight"], offset["mlp.gate.weight"],
                        offset["mlp.down.weight"])


def _adjacent(reg, name: str, offset: int) -> None:
    """The fused products read adjacent parameters as one matrix: refuse a
    registry where `name` is not where they need it."""
    if reg[name].offset != offset:
        raise ConfigError(f"{name}: at offset {reg[name].offset}, but the fused layout "
                          f"needs it at {offset} (right after the parameter before it)")
