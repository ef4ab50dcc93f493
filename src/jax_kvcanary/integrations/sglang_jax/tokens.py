"""The tokens the scheduler intends, on the device: the write-input assert and the token check.

With ``--kv-canary-write-input-assert`` each write compares the token and position every KV entry
is written with (the step's ``input_ids`` / ``positions``, what the forward consumed) against the
ones the scheduler intends for that request; with ``--kv-canary-token-check`` every verify also
compares each slot's stored token with the request's token at that position. Both read one
device-resident table, ``TokenMirror.pool``: ``int32 [R + 1, C]``, the token of each (request
pool row ``rp``, position) at row ``rp + 1`` (row 0 is the plan's padding row), -1 where unknown.
It is filled in step order, in the thread that runs the forward, from two sources:

- **the scheduler's host state** (EXTEND steps): each request's ``fill_ids`` (its prompt and the
  output so far) at the positions of the step's extend, plus, the first time a request is seen
  on its pool row, the positions of the prefix the prefix cache supplied. ``host_tokens`` builds
  them in the scheduler's thread (``SglangJaxCanary.before_launch``) and copies them to the device
  there, in chunks of ``CHUNK`` tokens; they are matched to their step by sglang-jax's batch id
  (``ForwardBatch.bid``). Each position of a request is sent once: no copy grows with the context.
- **the engine's sampler** (every step): the token it sampled for each live batch row is the
  request's token at position ``seq_len``, the input of the request's next DECODE step. It is
  stored on the device (``record``) from the sampler's output: the host never waits for it, so
  this holds under the overlap scheduler, where the host does not know a DECODE step's input
  token when it launches the step (sglang-jax resolves it on the device from its future map).

- **a speculative verify's accepted tokens** (EAGLE, ``speculative.record_verified_tokens``): a
  verify writes each request's last token and its draft tokens, and the tokens it commits are
  known only once it has run; they are stored (``commit``) at their positions, and the positions
  the request's next verify writes draft tokens to are made unknown (-1), since a draft token is
  no request's intended token until accepted (``lookahead``: a new request's too).

A DECODE step whose input token is not the token sampled for that request in its previous step
(sglang-jax's future map handing a request another request's token, the effect of sglang-jax
#1487) is then a ``write_token`` violation of the step that consumed it. An entry whose intended
token is unknown (-1) is not compared.
"""

from __future__ import annotations

import functools
import threading
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ...runtime.endpoints import CanaryBatch
from .layout import replicated

#: tokens per host-to-device chunk of ``host_tokens`` (one compiled ``apply`` for every size)
CHUNK = 512
#: the pool's "unknown" value (compared as "no check")
UNKNOWN = -1


def _apply(pool, chunk):
    """``pool[chunk[0], chunk[1]] = chunk[2]`` (rows out of range are padding, dropped)."""
    return pool.at[chunk[0], chunk[1]].set(chunk[2], mode="drop")


def _record(pool, req_pool_indices, seq_lens, next_token_ids, mesh=None):
    """Store each live batch row's sampled token at (``rp + 1``, ``seq_len``); the engine's batch
    arrays (sharded over its mesh's ``data`` axis) are read replicated, as the pool is."""
    get = replicated(mesh)
    req_pool_indices, seq_lens, next_token_ids = map(get, (req_pool_indices, seq_lens,
                                                           next_token_ids))
    n = min(req_pool_indices.shape[0], seq_lens.shape[0], next_token_ids.shape[0])
    rp, seq = req_pool_indices[:n], seq_lens[:n]
    rows = jnp.where((rp >= 0) & (seq > 0), rp + 1, pool.shape[0])
    return pool.at[rows, seq].set(next_token_ids[:n], mode="drop")


def with_intended_tokens(batch: CanaryBatch, pool, req_pool_indices) -> CanaryBatch:
    """Inside the step's launch: ``batch`` (``layout.page_table_batch``) with the intended tokens
    of ``pool`` (``TokenMirror.pool``): its plan rows name their pool rows (``req_pool_indices``
    + 1, replicated int32; 0 stays padding), the token pool and valid lengths of the token check,
    and the expected tokens and positions of the write-input assert (``expected_inputs``)."""
    rows = jnp.where(batch.req_pool_indices != 0, req_pool_indices + 1, 0)
    tokens, positions = expected_inputs(pool, rows, batch.prefix_lens, batch.extend_seq_lens,
                                        batch.input_ids, batch.positions)
    return batch._replace(req_pool_indices=rows, token_pool=pool,
                          token_valid_lens=batch.prefix_lens + batch.extend_seq_lens,
                          expected_input_tokens=tokens, expected_input_positions=positions)


def expected_inputs(pool, rows, prefix_lens, extend_lens, input_ids, positions):
    """Inside the step's launch: the intended token and position of each flat entry.

    Args:
      pool: ``int32 [R + 1, C]``, ``TokenMirror.pool``.
      rows: ``int32 [B]``, each batch row's pool row + 1 (0: a padding row).
      prefix_lens, extend_lens: ``int32 [B]``, the plan's lengths (entries are laid out row after
        row, ``extend_lens[r]`` of them at positions ``prefix_lens[r] + j``).
      input_ids, positions: ``[N]``, what the step consumed.

    Returns:
      ``(tokens, positions)``, ``[N]`` each, in the dtypes of ``input_ids`` / ``positions``: the
      pool's token at (row, position) and that position; an entry past the rows, or whose token
      is unknown, takes the step's own values (not compared).
    """
    n = input_ids.shape[0]
    ends = jnp.cumsum(extend_lens)
    i = jnp.arange(n, dtype=ends.dtype)
    r = jnp.searchsorted(ends, i, side="right")
    inside = r < extend_lens.shape[0]
    rc = jnp.clip(r, 0, extend_lens.shape[0] - 1)
    pos = prefix_lens[rc] + i - (ends[rc] - extend_lens[rc])
    cols = pool.shape[1]
    tok = pool[rows[rc], jnp.clip(pos, 0, cols - 1)]
    known = inside & (pos >= 0) & (pos < cols) & (tok != UNKNOWN)
    return (jnp.where(known, tok, input_ids).astype(input_ids.dtype),
            jnp.where(inside, pos, positions).astype(positions.dtype))


class TokenMirror:
    """The device-resident table of the tokens each request is meant to have (module docstring).

    Args:
      num_rows: rows of sglang-jax's ``req_to_token`` pool (``R``).
      num_cols: its width (``C``, the longest request).
      mesh: the engine's mesh; the table is replicated over it.
    """

    def __init__(self, num_rows: int, num_cols: int, mesh):
        self.shape = (int(num_rows) + 1, int(num_cols))
        self.lookahead = 0       # positions after a request's extend made unknown (speculative)
        self.sharding = NamedSharding(mesh, PartitionSpec())
        self._apply = jax.jit(_apply, donate_argnums=(0,), out_shardings=self.sharding)
        self._record = jax.jit(functools.partial(_record, mesh=mesh),
                               donate_argnums=(0,), out_shardings=self.sharding)
        self._sent = {}          # pool row -> (request id, positions sent); scheduler thread
        self._pending = {}       # batch id -> device chunks of its EXTEND tokens
        self._lock = threading.Lock()                    # _pending: both threads
        self.pool = None
        self.reset()

    def reset(self) -> None:
        """All tokens unknown (after the engine's precompile, whose batches are synthetic)."""
        self.pool = jax.device_put(np.full(self.shape, UNKNOWN, np.int32), self.sharding)
        self._sent.clear()
        with self._lock:
            self._pending.clear()

    def precompile(self) -> None:
        """Compile ``apply`` (``record`` is compiled by the engine's precompile, which samples)."""
        self.pool = self._apply(self.pool, self._chunks(np.zeros((3, 0), np.int64))[0])

    # -- the scheduler's thread -----------------------------------------------------------------
    def host_tokens(self, reqs) -> list:
        """The device chunks of an EXTEND batch's intended tokens (``reqs``: its requests).

        Each request contributes ``fill_ids[start:len(fill_ids)]`` at positions from ``start``:
        its extend, and, the first time it is seen on its pool row, its cached prefix too; then
        ``lookahead`` unknown positions (what an earlier request on the row left there)."""
        cells = []
        for req in reqs:
            rp, fill = int(req.req_pool_idx), req.fill_ids
            end = min(len(fill), self.shape[1])
            prefix = len(req.prefix_indices)
            rid, sent = self._sent.get(rp, (None, 0))
            start = min(sent, prefix) if rid == req.rid else 0
            self._sent[rp] = (req.rid, end)
            if end > start:
                pos = np.arange(start, end, dtype=np.int64)
                cells.append(np.stack([np.full_like(pos, rp + 1), pos,
                                       np.asarray(fill[start:end], np.int64)]))
            if self.lookahead:
                cells.append(self._unknown_after(rp + 1, end))
        return self._chunks(np.concatenate(cells, axis=1) if cells else np.zeros((3, 0), np.int64))

    def _chunks(self, cells: np.ndarray) -> list:
        """``cells`` ``[3, n]`` (row, position, token) as ``int32 [3, CHUNK]`` device arrays."""
        out = []
        for lo in range(0, max(cells.shape[1], 1), CHUNK):
            part = np.full((3, CHUNK), 0, np.int32)
            part[0] = self.shape[0]                      # padding: a row past the end, dropped
            piece = cells[:, lo:lo + CHUNK]
            part[:, :piece.shape[1]] = piece
            out.append(jax.device_put(part, self.sharding))
        return out

    def expect(self, bid: int, chunks: list) -> None:
        """Keep ``chunks`` (``host_tokens``) for the step of batch ``bid``."""
        with self._lock:
            self._pending[int(bid)] = chunks
            for old in sorted(self._pending)[:-64]:      # batches that never ran a step
                del self._pending[old]

    # -- the forward's thread -------------------------------------------------------------------
    def before_step(self, bid: Optional[int]) -> None:
        """Apply the host tokens of batch ``bid`` (if the scheduler sent any)."""
        with self._lock:
            chunks = self._pending.pop(bid, ())
        for chunk in chunks:
            self.pool = self._apply(self.pool, chunk)

    def after_sample(self, req_pool_indices, seq_lens, next_token_ids) -> None:
        """Store the sampler's tokens of the step (device arrays; nothing waits for them)."""
        self.pool = self._record(self.pool, req_pool_indices, seq_lens, next_token_ids)

    def commit(self, cells: np.ndarray) -> None:
        """Store host ``cells`` (``[3, n]``: pool row + 1, position, token) at once, each row's
        ``lookahead`` positions after its last cell unknown (a speculative verify's committed
        tokens, known on the host once it has run)."""
        rows, at = np.unique(cells[0], return_inverse=True)
        ends = np.zeros(rows.shape, np.int64)
        np.maximum.at(ends, at, cells[1] + 1)
        cells = np.concatenate([cells, self._unknown_after(rows, ends)], axis=1)
        for chunk in self._chunks(cells):
            self.pool = self._apply(self.pool, chunk)

    def _unknown_after(self, rows, ends) -> np.ndarray:
        """Cells making ``lookahead`` positions of each pool row ``rows[i]`` from ``ends[i]``
        unknown (scalars or matching arrays)."""
        rows, ends = np.atleast_1d(rows).astype(np.int64), np.atleast_1d(ends).astype(np.int64)
        pos = (ends[:, None] + np.arange(self.lookahead, dtype=np.int64)).reshape(-1)
        return np.stack([np.repeat(rows, self.lookahead), pos, np.full_like(pos, UNKNOWN)])
