"""The write-input assert and the token check of the sglang-jax integration, without sglang-jax:
the intended-token table (``tokens.TokenMirror``) against a numpy reference, and a fake runner
whose DECODE step consumes another request's token."""

import logging
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jax_kvcanary.integrations import sglang_jax as kvc_sgl
from jax_kvcanary.integrations.sglang_jax import tokens
from jax_kvcanary.runtime import CanaryConfig
from tests.support.sglang_fakes import fake_runner

pytestmark = pytest.mark.integration


def expected_inputs_reference(pool, rows, prefix, extend, input_ids, positions):
    """What ``tokens.expected_inputs`` computes, one entry at a time."""
    tok, pos = np.array(input_ids), np.array(positions)
    i = 0
    for r in range(len(rows)):
        for j in range(extend[r]):
            if i >= len(tok):
                return tok, pos
            p = prefix[r] + j
            pos[i] = p
            t = pool[rows[r], p] if 0 <= p < pool.shape[1] else tokens.UNKNOWN
            if t != tokens.UNKNOWN:
                tok[i] = t
            i += 1
    return tok, pos


@pytest.mark.parametrize("seed", range(6))
def test_expected_inputs_match_the_reference(seed):
    rng = np.random.default_rng(seed)
    bs, cols, n = int(rng.integers(1, 6)), 12, 16
    pool = rng.integers(0, 50, (bs + 2, cols)).astype(np.int32)
    pool[rng.random(pool.shape) < 0.3] = tokens.UNKNOWN
    pool[0] = tokens.UNKNOWN                                 # the padding row
    live = rng.random(bs) < 0.8
    rows = np.where(live, rng.integers(1, bs + 2, bs), 0).astype(np.int32)
    extend = np.where(live, rng.integers(0, 5, bs), 0).astype(np.int32)
    prefix = np.where(live, rng.integers(0, cols, bs), 0).astype(np.int32)   # may run past C
    input_ids = rng.integers(0, 50, n).astype(np.int32)
    positions = rng.integers(0, 20, n).astype(np.int32)
    got = tokens.expected_inputs(*map(jnp.asarray, (pool, rows, prefix, extend, input_ids,
                                                    positions)))
    want = expected_inputs_reference(pool, rows, prefix, extend, input_ids, positions)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), w)


def req(rid, rp, fill, prefix):
    return types.SimpleNamespace(rid=rid, req_pool_idx=rp, fill_ids=list(fill),
                                 prefix_indices=list(range(prefix)))


def test_the_mirror_sends_each_position_once_and_stores_the_sampled_tokens():
    mesh = jax.make_mesh((1,), ("data",))
    m = tokens.TokenMirror(4, 8, mesh)
    # request a on pool row 1: a cached prefix of 2 (sent with it), then its first chunk of 3
    m.expect(10, m.host_tokens([req("a", 1, [7, 8, 9, 10, 11], 2)]))
    m.before_step(10)
    assert np.asarray(m.pool)[2].tolist() == [7, 8, 9, 10, 11, -1, -1, -1]
    # its next chunk: positions 5 and 6 only (nothing from before is sent again)
    chunks = m.host_tokens([req("a", 1, [7, 8, 9, 10, 11, 12, 13], 5)])
    assert np.asarray(chunks[0])[2, :3].tolist() == [12, 13, 0]
    m.expect(11, chunks)
    m.before_step(99)                                        # another batch id: nothing applied
    assert np.asarray(m.pool)[2, 5] == -1
    m.before_step(11)
    # the sampler: row 0 (pool row 1, 7 tokens) sampled 42; a padding row samples nothing
    m.after_sample(jnp.array([1, -1], jnp.int32), jnp.array([7, 0], jnp.int32),
                   jnp.array([42, 5], jnp.int32))
    pool = np.asarray(m.pool)
    assert pool[2].tolist() == [7, 8, 9, 10, 11, 12, 13, 42]
    assert (pool[[0, 1, 3, 4]] == -1).all()
    # another request on the same pool row starts from position 0
    m.expect(12, m.host_tokens([req("b", 1, [3, 4], 0)]))
    m.before_step(12)
    assert np.asarray(m.pool)[2, :3].tolist() == [3, 4, 9]
    # more tokens than a chunk holds go in several chunks
    big = tokens.TokenMirror(4, tokens.CHUNK * 2, mesh)
    assert len(big.host_tokens([req("c", 3, range(1, 8), 0),
                                req("d", 0, range(tokens.CHUNK + 1), 0)])) == 2


@pytest.mark.parametrize("consumed, reasons", [(31, set()), (32, {"write_token", "verify_token"})])
def test_a_decode_step_that_consumes_another_request_s_token_is_a_write_token_violation(
        consumed, reasons):
    mesh = jax.make_mesh((1,), ("data",))
    data = NamedSharding(mesh, PartitionSpec("data"))
    kv0 = jax.device_put(np.zeros((64, 1, 4, 1, 8), np.float32), NamedSharding(mesh, PartitionSpec()))
    outputs = (None, {"token_to_kv_pool": [kv0]}, None, None)
    sampled = [jnp.array([31, 32], jnp.int32), jnp.array([33, 34], jnp.int32)]
    runner = fake_runner(
        kv0, jitted_run_model=lambda fb, lm: outputs, mesh=mesh,
        req_to_token_pool=types.SimpleNamespace(req_to_token=np.zeros((4, 16), np.int32)),
        jitted_sampler=lambda step, logits, meta: (sampled.pop(0), None, None))
    quiet = logging.getLogger("kvc-tokens-quiet")
    quiet.disabled = True
    canary = kvc_sgl.install(runner, CanaryConfig(mode="log", health_interval=0,
                                                  write_input_assert=True, token_check=True),
                             logger=quiet)

    def step(bid, decode, ids, positions, seq, loc, out, prefix=None, extend=None):
        a = dict(extend_prefix_lens=None, extend_seq_lens=None,
                 req_pool_indices=np.array([0, 2], np.int32), seq_lens=np.array(seq, np.int32),
                 cache_loc=np.array(loc, np.int32), input_ids=np.array(ids, np.int32),
                 positions=np.array(positions, np.int32), out_cache_loc=np.array(out, np.int32))
        if not decode:
            a.update(extend_prefix_lens=np.array(prefix, np.int32),
                     extend_seq_lens=np.array(extend, np.int32))
        fb = types.SimpleNamespace(
            bid=bid, forward_mode=types.SimpleNamespace(is_decode=lambda: decode,
                                                        is_target_verify=lambda: False),
            **{k: None if v is None else jax.device_put(v, data) for k, v in a.items()})
        runner.jitted_run_model(fb, None)
        runner.jitted_sampler(0, None, None)

    # two requests' prompts (pool rows 0 and 2), sent by the scheduler for batch 1
    batch = types.SimpleNamespace(forward_mode=types.SimpleNamespace(is_extend=lambda: True),
                                  reqs=[req("a", 0, [5, 6, 7], 0), req("b", 2, [8, 9], 0)])
    canary.before_launch(batch)
    canary.before_forward(types.SimpleNamespace(bid=1))
    step(1, False, [5, 6, 7, 8, 9, 0], [0, 1, 2, 0, 1, 0], [3, 2], [1, 2, 3, 4, 5, 0],
         [1, 2, 3, 4, 5, -1], prefix=[0, 0], extend=[3, 2])
    # the DECODE step: request a's input must be 31 (sampled for it), b's 32
    step(2, True, [consumed, 32], [3, 2], [4, 3], [1, 2, 3, 6, 4, 5, 7, 0], [6, 7])
    canary.flush()
    new = canary.monitor.violations               # (the idle reporter may have decoded them)
    assert {r for v in new for r in v.reasons} == reasons
    if reasons:
        assert {v.slot for v in new} == {6}
