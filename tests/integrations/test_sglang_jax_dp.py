"""Data-parallel attention without a server: the canary installed into a runner on a
``("data", "tensor")`` mesh of (2, 1) and (2, 2) forced host devices, whose model call returns a
fused KV buffer of two rank sections (each with its own padding slot, addressed by rank-local slot
ids) and whose batch arrays are per-rank sections placed ``P("data")``, as sglang-jax lays them.

Each case serves two requests, one per rank, holding the *same* rank-local slots, then plants:
a change of rank 1's KV (reported on rank 1 only, by the steps and by a sweep of rank 1's prefix
cache), and the write of sglang-jax's CPU data-parallel path, where rank 1's new token lands in
rank 0's rows at its rank-local slot id (reported on rank 0 only). The counters count each slot
once, whatever the tensor-parallel width.

Runs in a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=4 (the flag must be
set before JAX starts its CPU backend)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.integration

SCRIPT = textwrap.dedent(r"""
    import json, logging, sys, types
    import jax, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jax_kvcanary.integrations import sglang_jax as kvc_sgl
    from jax_kvcanary.integrations.sglang_jax.metrics import CanaryTotals
    from jax_kvcanary.runtime import CanaryConfig
    from tests.support.sglang_fakes import fake_runner, forward_batch

    DP, TPD = (int(x) for x in sys.argv[1:3])
    SLOTS, BS, LOC = 16, 2, 8                  # slots per rank (slot 0 padding), rows, table
    mesh = jax.make_mesh((DP, TPD), ("data", "tensor"), devices=jax.devices()[:DP * TPD])
    kv_sharding = NamedSharding(mesh, P("data", None, "tensor", None, None))
    kv_host = np.zeros((DP * SLOTS, 1, 4, 1, 8), np.float32)
    held = {}

    def model_call(fb, lm):                  # the step's KV, stored back as the engine does
        kv = runner.token_to_kv_pool.kv_buffer[0] = jax.device_put(kv_host, kv_sharding)
        return None, {"token_to_kv_pool": [kv]}, None, None

    runner = fake_runner(jax.device_put(kv_host, kv_sharding), mesh=mesh, dp_size=DP,
                         jitted_run_model=model_call)
    log = logging.getLogger("kvc-dp")
    log.disabled = True
    root = types.SimpleNamespace(children={}, key=None, value=None)
    canary = kvc_sgl.install(runner, CanaryConfig(mode="log", health_interval=0, sweep_interval=1),
                             logger=log, tree_cache=types.SimpleNamespace(root_node=root))

    def write(rank, slot, token, pos, *, land_rank=None):
        # the model's KV write of one token; land_rank: the rank whose rows it lands in
        row = (rank if land_rank is None else land_rank) * SLOTS + slot
        kv_host[row] = token * 1000 + pos + rank * 0.5

    def step(bid, reqs, *, decode, land=None):
        # reqs: per rank None (idle) or (req_pool_idx, slots, tokens, new): its KV slots so
        # far (new ones last), the tokens of its new positions
        cols = {k: [] for k in ("req_pool_indices", "seq_lens", "extend_prefix_lens",
                                "extend_seq_lens", "cache_loc", "input_ids", "positions",
                                "out_cache_loc")}
        ntok = 1 if decode else 4
        for rank, r in enumerate(reqs):
            rp, slots, toks = (-1, [], []) if r is None else r
            n, new = len(slots), len(toks)
            cols["req_pool_indices"] += [rp] + [-1] * (BS - 1)
            cols["seq_lens"] += [n] + [0] * (BS - 1)
            cols["extend_prefix_lens"] += [n - new] + [0] * (BS - 1)
            cols["extend_seq_lens"] += [new] + [0] * (BS - 1)
            cols["cache_loc"] += list(slots) + [0] * (LOC - n)
            cols["input_ids"] += list(toks) + [0] * (ntok - new)
            cols["positions"] += list(range(n - new, n)) + [0] * (ntok - new)
            cols["out_cache_loc"] += list(slots[n - new:]) + [-1] * (ntok - new)
            for i, t in enumerate(toks):
                write(rank, slots[n - new + i], t, n - new + i,
                      land_rank=(land or {}).get(rank))
        if decode:
            cols["extend_prefix_lens"] = cols["extend_seq_lens"] = None
        fb = forward_batch(mesh, bid=bid, decode=decode, **cols)
        runner.jitted_run_model(fb, None)

    def sweep_tree(prefixes):
        # the radix cache: per rank, one node holding that rank's cached prompt slots
        root.children = {(r, 0): types.SimpleNamespace(
            children={}, key=types.SimpleNamespace(dp_rank=r), value=np.asarray(s, np.int64))
            for r, s in prefixes.items()}

    def found(new):
        return sorted({(v.device, v.tag_name, v.slot, "+".join(v.reasons),
                        v.report.splitlines()[-1].split(" (")[0].strip()) for v in new})

    out = {"num_slots": canary.num_slots,
           "state_blocks": sorted(s.data.shape[0] for s in canary.state.log.ring.addressable_shards)}
    a, b = [1, 2, 3, 4], [1, 2, 3, 4]          # the same rank-local slots on both ranks
    step(1, [(0, a, [10, 11, 12, 13]), (1, b, [20, 21, 22, 23])], decode=False)
    a, b = a + [5], b + [5]
    step(2, [(0, a, [14]), (1, b, [24])], decode=True)
    sweep_tree({0: a[:4], 1: b[:4]})
    canary.sweep_now()
    step(3, [(0, a, []), (1, b, [])], decode=True)   # a step that runs the sweep, writes nothing
    out["clean"] = found(canary.flush())
    totals = CanaryTotals.read(canary)
    out["written"] = totals.written.get("HEAD_K_FULL")

    kv_host[1 * SLOTS + 2] += 1.0                # rank 1's slot 2 (position 1 of request 1)
    runner.token_to_kv_pool.kv_buffer[0] = jax.device_put(kv_host, kv_sharding)
    canary.sweep_now()
    a, b = a + [6], b + [6]
    step(4, [(0, a, [15]), (1, b, [25])], decode=True)
    out["rank1_fault"] = found(canary.flush())
    kv_host[1 * SLOTS + 2] -= 1.0

    # sglang-jax's CPU DP path: rank 1's new token at its local slot 7 lands in rank 0's row 7,
    # which rank 0's request holds
    a = a + [7]
    step(5, [(0, a, [16]), None], decode=True)
    b = b + [7]
    step(6, [None, (1, b, [26])], decode=True, land={1: 0})
    step(7, [(0, a + [8], [17]), (1, b + [8], [27])], decode=True)
    out["cross_rank"] = found(canary.flush())
    print("RESULT", json.dumps(out))
""")


def run_case(dp: int, tpd: int) -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(dp), str(tpd)], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(next(l for l in r.stdout.splitlines() if l.startswith("RESULT "))[7:])


@pytest.fixture(scope="module")
def cases():
    return {mesh: run_case(*mesh) for mesh in ((2, 1), (2, 2))}


@pytest.mark.parametrize("mesh", [(2, 1), (2, 2)])
def test_each_rank_is_guarded_on_its_own_slots(cases, mesh):
    out = cases[mesh]
    dp, tpd = mesh
    assert out["num_slots"] == 16                       # one rank's section, its padding slot incl.
    assert out["state_blocks"] == [1] * (dp * tpd)      # one canary state per device
    assert out["clean"] == []                           # the same local slots live on both ranks
    rank1 = list(range(tpd, 2 * tpd))
    # the steps' TAIL verify and the sweep both see rank 1's slot 2, on rank 1's devices only
    assert {d for d, *_ in out["rank1_fault"]} == set(rank1)
    assert {(tag, slot, why) for _, tag, slot, why, _ in out["rank1_fault"]} == {
        ("TAIL_K_FULL", 2, "verify_real_kv_hash"), ("TAIL_V_FULL", 2, "verify_real_kv_hash"),
        ("SWEEP_K_FULL", 2, "verify_real_kv_hash"), ("SWEEP_V_FULL", 2, "verify_real_kv_hash")}
    assert all(line.startswith(f"device={d} dp_rank=1") for d, *_, line in out["rank1_fault"])
    # rank 1's write landing in rank 0's row 7: rank 0's request read it, rank 0 reports it
    rank0 = list(range(tpd))
    assert {d for d, *_ in out["cross_rank"]} == set(rank0)
    assert {(tag, slot, why) for _, tag, slot, why, _ in out["cross_rank"]} == {
        ("TAIL_K_FULL", 7, "verify_real_kv_hash"), ("TAIL_V_FULL", 7, "verify_real_kv_hash")}
    assert all(line.startswith(f"device={d} dp_rank=0") for d, *_, line in out["cross_rank"])


def test_a_slot_counts_once_whatever_the_tensor_width(cases):
    # two ranks x (4 prompt slots + 1 decode slot) written by the clean steps
    assert cases[(2, 1)]["written"] == cases[(2, 2)]["written"] == 10
