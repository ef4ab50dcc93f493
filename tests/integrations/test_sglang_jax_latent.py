"""The canary's adapter for sglang-jax's absorbed-MLA latent pool (``MLATokenToKVPool``: the
pool of ``--attention-backend fa`` and ``dsa_sparse`` with MLA models), against a pool built on
the CPU with known contents.

The kernels that write and read that pool run on TPUs only, so no server serves it here and the
launcher refuses it before start (``pools.LATENT``). These tests build the engine's own pool
class, lay known latent rows and DSA indexer keys into it with the engine's own flat-to-paged
layout (``flat_to_paged_cache``, the layout its DSA kernels read through ``reshape(-1, kv_dim)``),
and check that the canary reads, in place, each slot's compressed KV, rope part and indexer keys,
then that a canary installed over a runner holding the pool is clean on the known contents and
reports a changed byte of each part at its slot.
"""

import logging

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from tests.support.sglang_server import installed_sglang_jax

pytestmark = pytest.mark.integration
if installed_sglang_jax() != "main":
    pytest.skip("these tests need sglang-jax's main branch (BUILD.md)", allow_module_level=True)

from sgl_jax.srt.kernels.dsa.sparse_mla_prefill import flat_to_paged_cache  # noqa: E402
from sgl_jax.srt.kernels.mla.v2.kernel import get_dtype_packing  # noqa: E402
from sgl_jax.srt.mem_cache.memory_pool import MLATokenToKVPool  # noqa: E402

from jax_kvcanary import hashing  # noqa: E402
from jax_kvcanary.consts import RealKvHashMode  # noqa: E402
from jax_kvcanary.integrations import sglang_jax as kvc_sgl  # noqa: E402
from jax_kvcanary.integrations.sglang_jax import layout, pools  # noqa: E402
from jax_kvcanary.runtime import CanaryConfig  # noqa: E402
from tests.support.sglang_fakes import FakeReq, FakeScheduler, fake_runner, forward_batch  # noqa: E402

QUIET = logging.getLogger("kvc-latent-quiet")
QUIET.disabled = True
RANK, ROPE, INDEX = 96, 32, 64          # kv_lora_rank, qk_rope_head_dim, indexer_key_dim


def known_pool(dtype, page_size: int, indexer: bool, seed: int = 0):
    """The engine's latent pool on a one-device mesh, every slot ``s`` holding known random rows:
    returns ``(pool, rows [slots, kv_dim], keys [slots, indexer_dim] or None)``."""
    mesh = jax.make_mesh((1, 1), ("data", "tensor"))
    pool = MLATokenToKVPool(size=16, page_size=page_size, dtype=dtype, kv_lora_rank=RANK,
                            qk_rope_head_dim=ROPE, layer_num=2, mesh=mesh,
                            indexer_key_dim=INDEX if indexer else 0,
                            num_indexer_layers=1 if indexer else 0)
    rng = np.random.default_rng(seed)
    npdt = ml_dtypes.bfloat16 if dtype == jnp.bfloat16 else np.dtype(dtype)
    slots = pool.kv_buffer[0].shape[0] * page_size

    def paged(dim):
        flat = rng.standard_normal((slots, dim)).astype(npdt)
        cache, _ = flat_to_paged_cache(flat[None], page_size, get_dtype_packing(dtype))
        return flat, jax.device_put(cache, pool.kv_sharding)

    rows, kv = paged(pool.kv_dim)
    keys, idx = paged(pool.indexer_key_dim) if indexer else (None, None)
    pool.replace_buffer(([kv, kv], [idx] if indexer else []))   # the engine's store of a step
    return pool, rows, keys


@pytest.mark.parametrize("dtype, page_size", [(jnp.float32, 1), (jnp.bfloat16, 2),
                                              (jnp.bfloat16, 4)])
@pytest.mark.parametrize("mode", [RealKvHashMode.PARTIAL, RealKvHashMode.ALL])
def test_each_slot_s_compressed_kv_rope_part_and_indexer_keys_are_read_in_place(dtype, page_size,
                                                                             mode):
    pool, rows, keys = known_pool(dtype, page_size, indexer=True)
    dims = layout.LatentDims(pool.nope_dim, pool.rope_dim)
    srcs = layout.latent_kv_sources(pool.kv_buffer[0], pool.indexer_key_buffer[0], dims,
                                    page_size, mode)
    c_kv, k_pe = (np.asarray(a).reshape(rows.shape[0], -1) for a in pool.get_kv_buffer(0))
    part = mode == RealKvHashMode.PARTIAL
    for s in range(rows.shape[0]):
        assert (c_kv[s] == rows[s, :RANK]).all() and (k_pe[s] == rows[s, pool.nope_dim:][:ROPE]).all()
        row, key = rows[s].view(np.uint8), keys[s].view(np.uint8)
        isz = rows.itemsize
        k = row[:16] if part else row[:pool.nope_dim * isz]
        rope = row[pool.nope_dim * isz:][:16 if part else pool.rope_dim * isz]
        idx = key[:16] if part else key
        assert hashing.slot_real_kv_hash((srcs["K"],), s, int(mode)) == hashing.real_kv_hash([k])
        assert (hashing.slot_real_kv_hash(srcs["V"], s, int(mode))
                == hashing.real_kv_hash([rope, idx])), s


def test_the_latent_geometry_is_refused_when_the_buffer_is_not_a_latent_one():
    with pytest.raises(ValueError, match="^kv-canary: expected the latent buffer"):
        layout.latent_geometry(np.zeros((4, 2, 2, 128), np.float32), page_size=8)
    with pytest.raises(ValueError, match="^kv-canary: expected the latent buffer"):
        layout.latent_geometry(np.zeros((4, 4, 128), np.float32), page_size=4)


def latent_runner(pool):
    """A main-layout runner holding ``pool`` whose model call returns the pool's current buffers
    as a DSA step's updates (latent buffers, indexer buffers)."""
    runner = fake_runner(pool.kv_buffer[0], token_to_kv_pool=pool, mesh=pool.mesh,
                         page_size=pool.page_size,
                         server_args=type("A", (), {"attention_backend": "dsa_sparse"})())
    runner.jitted_run_model = lambda fb, lm: (
        None, {"token_to_kv_pool": (list(pool.kv_buffer), list(pool.indexer_key_buffer))},
        None, None)
    return runner


def test_the_launcher_refuses_the_latent_pool_and_the_install_guards_it():
    assert pools.refusal("MLATokenToKVPool").startswith(
        "kv-canary: the KV pool MLATokenToKVPool is not supported: its kernels (absorbed MLA, DSA) "
        "run on TPUs only")
    assert pools.install_refusal("MLATokenToKVPool") is None
    pool, _, _ = known_pool(jnp.bfloat16, 4, indexer=True)
    lay = layout.runner_layout(latent_runner(pool))
    assert isinstance(lay, layout.PoolsRunner) and lay.latent == (128, 128)
    assert lay.geometry.num_slots == pool.kv_buffer[0].shape[0] * 4 and lay.aligned_segments


@pytest.mark.parametrize("part, byte", [("compressed KV", 3), ("rope part", 129 * 2),
                                        ("indexer keys", 5)])
def test_a_canary_over_the_latent_pool_is_clean_then_reports_a_changed_byte_at_its_slot(part,
                                                                                       byte):
    """Two requests of two pages each (slots 4-11 and 12-19, page size 4): a prefill writes three
    tokens each, decodes read them back clean; one byte of slot 13's ``part`` is changed, and the
    next decode reports slot 13 (request b's position 1) and nothing else."""
    pool, _, _ = known_pool(jnp.bfloat16, 4, indexer=True)
    runner = latent_runner(pool)
    slots = {1: list(range(4, 12)), 2: list(range(12, 20))}
    table = np.zeros((4, 16), np.int32)
    for row, held in slots.items():
        table[row, :8] = held
    sched = FakeScheduler(runner, [FakeReq("a", 1, 3), FakeReq("b", 2, 3)], table)
    canary = kvc_sgl.install_into_scheduler(
        sched, CanaryConfig(mode="log", health_interval=0, real_kv_hash_mode="PARTIAL"),
        logger=QUIET)

    def step(bid, seq, decode):
        """Both requests at ``seq`` tokens; ``cache_loc`` in whole pages per request (the layout
        page-granular kernels read)."""
        span = -(-seq // 4) * 4
        new = range(seq - 1, seq) if decode else range(seq)
        fb = forward_batch(
            runner.mesh, bid=bid, decode=decode, req_pool_indices=[1, 2], seq_lens=[seq, seq],
            extend_prefix_lens=None if decode else [0, 0],
            extend_seq_lens=None if decode else [seq, seq],
            cache_loc=slots[1][:span] + slots[2][:span],
            input_ids=[10 * r + p for r in (1, 2) for p in new], positions=[*new, *new],
            out_cache_loc=[slots[r][p] for r in (1, 2) for p in new])
        runner.jitted_run_model(fb, None)
        sched.process_batch_result(sched.batch, type("R", (), {"bid": bid})())
        return list(canary.monitor.violations)

    assert step(1, 3, decode=False) == [] and step(2, 4, decode=True) == []
    buffers = pool.indexer_key_buffer if part == "indexer keys" else pool.kv_buffer
    arr = np.array(buffers[0])
    arr.reshape(-1, arr.shape[-1])[13].view(np.uint8)[byte] ^= 0x40
    buffers[0] = jax.device_put(arr, pool.kv_sharding)
    rows = step(3, 5, decode=True)
    assert rows and {v.slot for v in rows} == {13}, [v.report for v in rows]
    assert {v.tag_name.split("_")[1] for v in rows} == {"K" if part == "compressed KV" else "V"}
