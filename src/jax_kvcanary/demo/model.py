"""A tiny transformer decoder in pure JAX with a paged KV cache (the demo's model).

Random weights, greedy sampling. Attention heads (and so the KV cache) are split over ``tp``
devices: each device holds ``heads // tp`` heads of every layer's K/V. Layers are ``'full'``
(attend to every earlier position) or ``'swa'`` (a sliding window, over a separate SWA slot pool
reached through the ``full_to_swa`` LUT).

KV array of one layer and half (per device): ``float32[pages, page_size, heads // tp, head_dim]``;
slot ``s`` lives at ``[s // page_size, s % page_size]``, so ``kv[r]`` is one page, which is the
row layout ``RealKvSource`` expects.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from ..inputs import RealKvSource


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab: int = 256
    d_model: int = 64
    heads: int = 4
    head_dim: int = 16
    mlp: int = 128
    layers: Tuple[str, ...] = ("full", "swa")
    swa_window: int = 16
    page_size: int = 16
    max_seq_len: int = 64
    tp: int = 1

    @property
    def local_heads(self) -> int:
        return self.heads // self.tp

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's K (or V) of one layer on one device (a multiple of 16)."""
        return self.local_heads * self.head_dim * 4

    def first_layer(self, kind: str) -> Optional[int]:
        return self.layers.index(kind) if kind in self.layers else None


def init_params(cfg: ModelConfig, seed: int = 0):
    """``(replicated, sharded)`` parameter dicts (numpy, float32). Sharded leaves have a leading
    ``[tp]`` axis (each device's heads)."""
    if cfg.heads % cfg.tp:
        raise ValueError(f"toy model: {cfg.heads} heads do not split over {cfg.tp} devices")
    rng = np.random.default_rng(seed)
    d, h, k, hl = cfg.d_model, cfg.heads, cfg.head_dim, cfg.local_heads
    n = lambda *s, scale: (rng.standard_normal(s) * scale).astype(np.float32)  # noqa: E731
    nl = len(cfg.layers)
    rep = {"embed": n(cfg.vocab, d, scale=1.0), "pos": n(cfg.max_seq_len, d, scale=0.3),
           "w1": n(nl, d, cfg.mlp, scale=d ** -0.5), "w2": n(nl, cfg.mlp, d, scale=cfg.mlp ** -0.5),
           "unembed": n(d, cfg.vocab, scale=d ** -0.5)}

    def heads_split(w):  # [nl, d, h, k] -> [tp, nl, d, hl, k]
        return np.ascontiguousarray(np.moveaxis(w.reshape(nl, d, cfg.tp, hl, k), 2, 0))

    sh = {name: heads_split(n(nl, d, h, k, scale=d ** -0.5)) for name in ("wq", "wk", "wv")}
    wo = n(nl, h, k, d, scale=(h * k) ** -0.5).reshape(nl, cfg.tp, hl, k, d)
    sh["wo"] = np.ascontiguousarray(np.moveaxis(wo, 1, 0))
    return rep, sh


def init_kv(cfg: ModelConfig, num_slots: int, swa_num_slots: int):
    """Zero KV arrays of one device: ``{'k': [..per layer..], 'v': [...]}``."""
    def arr(slots):
        return jnp.zeros((slots // cfg.page_size, cfg.page_size, cfg.local_heads, cfg.head_dim),
                         jnp.float32)
    slots = [num_slots if kind == "full" else swa_num_slots for kind in cfg.layers]
    return {"k": [arr(s) for s in slots], "v": [arr(s) for s in slots]}


def real_kv_sources(cfg: ModelConfig, kv, mode_bytes: Optional[int] = None):
    """``{group: {half: RealKvSource}}`` over layer 0 of each group (the first full / swa layer)."""
    out = {}
    for group, kind in (("FULL", "full"), ("SWA", "swa")):
        li = cfg.first_layer(kind)
        if li is None:
            continue
        out[group] = {h.upper(): RealKvSource(kv[h][li], cfg.page_size, cfg.token_bytes,
                                              mode_bytes or cfg.token_bytes) for h in ("k", "v")}
    return out


def _rms(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def _lut(lut, x):
    n = lut.shape[0]
    return jnp.where((x >= 0) & (x < n), jnp.take(lut, jnp.clip(x, 0, n - 1)), 0)


def forward(cfg: ModelConfig, rep, sh, kv, b, axis_name=None):
    """One serving step of the model on one device.

    ``b`` (dict of int32 arrays): ``input_ids, positions, out_cache_loc, token_rp`` [N] (pool row of
    each token, 0 = padding), ``last_index`` [B] (flat index of each row's last token),
    ``req_to_token`` [R, L], ``lut`` [S_full]. ``rep`` / ``sh``: this device's parameters.
    Returns ``(kv, next_tokens int32[B])``; K/V of this step are written at ``out_cache_loc``
    (SWA layers at ``lut[out_cache_loc]``) before attention reads them.
    """
    ids, pos, loc, trp = b["input_ids"], b["positions"], b["out_cache_loc"], b["token_rp"]
    valid = trp != 0
    x = jnp.take(rep["embed"], ids, axis=0) + jnp.take(rep["pos"], jnp.clip(pos, 0, cfg.max_seq_len - 1), axis=0)
    slots_full = jnp.take(b["req_to_token"], trp, axis=0)                 # [N, L]
    j = jnp.arange(slots_full.shape[1])
    causal = j[None, :] <= pos[:, None]
    new_kv = {"k": list(kv["k"]), "v": list(kv["v"])}
    for li, kind in enumerate(cfg.layers):
        h = _rms(x)
        q = jnp.einsum("nd,dhk->nhk", h, sh["wq"][li])
        k = jnp.einsum("nd,dhk->nhk", h, sh["wk"][li])
        v = jnp.einsum("nd,dhk->nhk", h, sh["wv"][li])
        if kind == "swa":
            wloc, kslots = _lut(b["lut"], loc), _lut(b["lut"], slots_full)
            mask = causal & (j[None, :] > pos[:, None] - cfg.swa_window)
        else:
            wloc, kslots, mask = loc, slots_full, causal
        wloc = jnp.where(valid, wloc, 0)                                  # padded tokens -> slot 0
        outs = []
        for half, val in (("k", k), ("v", v)):
            arr = new_kv[half][li]
            flat = arr.reshape((-1,) + arr.shape[2:]).at[wloc].set(val)
            new_kv[half][li] = flat.reshape(arr.shape)
            outs.append(jnp.take(flat, kslots, axis=0))                   # [N, L, hl, k]
        keys, vals = outs
        s = jnp.einsum("nhk,nlhk->nhl", q, keys) * (cfg.head_dim ** -0.5)
        s = jnp.where(mask[:, None, :], s, -1e30)
        o = jnp.einsum("nhl,nlhk->nhk", jax.nn.softmax(s, axis=-1), vals)
        o = jnp.einsum("nhk,hkd->nd", o, sh["wo"][li])
        if axis_name is not None:
            o = jax.lax.psum(o, axis_name)
        x = x + o
        x = x + jax.nn.gelu(_rms(x) @ rep["w1"][li]) @ rep["w2"][li]
    last = jnp.take(x, jnp.clip(b["last_index"], 0, x.shape[0] - 1), axis=0)
    logits = _rms(last) @ rep["unembed"]
    logits = logits.at[:, 0].set(-1e30)                                  # never sample token 0
    return new_kv, jnp.argmax(logits, axis=-1).astype(jnp.int32)
