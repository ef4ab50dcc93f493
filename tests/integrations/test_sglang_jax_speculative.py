"""Speculative decoding's pieces without a server: the refusals before start, the health check that
ends a server whose speculative batch ran a model call a canary did not see, a verify step planned
from the attention metadata the ``fa`` kernel reads (``layout.attention_arrays``), the draft
model's steps planned the same way with records at KV positions, and a verify's committed tokens
as the write-input assert and the token check read them (``verified_cells``)."""

import types

import jax.numpy as jnp
import numpy as np
import pytest

from jax_kvcanary.runtime import CanaryConfig
from jax_kvcanary.runtime.errors import CanaryHealthError

pytestmark = pytest.mark.integration
pytest.importorskip("jax_kvcanary.integrations.sglang_jax")

from jax_kvcanary.integrations.sglang_jax import layout, speculative  # noqa: E402
from jax_kvcanary.integrations.sglang_jax.inject import InjectSpec  # noqa: E402
from jax_kvcanary.integrations.sglang_jax.request_guard import named_batch_rows  # noqa: E402

LOG = CanaryConfig(mode="log")
NOT_FUSED = {speculative.FUSED_EAGLE3_SWITCH: "1"}


def spec_args(**kw):
    a = dict(speculative_algorithm="EAGLE3", speculative_eagle_topk=1, speculative_num_steps=3,
             speculative_num_draft_tokens=4, disable_overlap_schedule=True, attention_backend="fa",
             tp_size=1, disaggregation_mode="null", hicache_storage="disable")
    a.update(kw)
    return types.SimpleNamespace(**a)


def settings(args, config=LOG, inject=None, environ=NOT_FUSED):
    return [setting for setting, _, _ in speculative.refusals(args, config, inject, environ)]


def test_eagle_and_eagle3_top_k_1_without_fused_paths_are_guarded():
    assert settings(spec_args()) == [] and settings(spec_args(speculative_algorithm="EAGLE")) == []
    assert settings(spec_args(speculative_algorithm=None)) == []
    assert settings(spec_args(), inject=InjectSpec("real_kv_used")) == []


@pytest.mark.parametrize("change, environ, setting, fix", [
    (dict(speculative_algorithm="NEXTN"), NOT_FUSED, "--speculative-algorithm NEXTN",
     "use EAGLE or EAGLE3"),
    (dict(speculative_eagle_topk=4), NOT_FUSED, "--speculative-eagle-topk 4",
     "use --speculative-eagle-topk 1"),
    (dict(disable_overlap_schedule=False), NOT_FUSED,
     "--speculative-algorithm EAGLE3 with the overlap scheduler", "add --disable-overlap-schedule"),
    ({}, {}, "--speculative-algorithm EAGLE3 with its fused verify",
     "set SGL_JAX_DISABLE_FUSED_EAGLE3_RECURRENT_DRAFT=1"),
    (dict(attention_backend="native"), NOT_FUSED,
     "--speculative-algorithm EAGLE3 with --attention-backend native", "use --attention-backend fa"),
    (dict(tp_size=2), NOT_FUSED, "--speculative-algorithm EAGLE3 with --tp-size 2",
     "use --tp-size 1"),
    (dict(hicache_storage="none"), NOT_FUSED, "--speculative-algorithm EAGLE3 with HiCache or PD",
     "drop --hicache-storage"),
])
def test_each_unguarded_speculative_setting_is_refused_with_its_fix(change, environ, setting, fix):
    got = speculative.refusals(spec_args(**change), LOG, None, environ)
    assert [s for s, _, _ in got] == [setting] and fix in got[0][2], got


def test_the_fused_eagle3_verify_is_only_refused_where_sglang_jax_would_take_it():
    # EAGLE runs no fused verify; nor does EAGLE3 with more draft tokens than steps + 1
    assert settings(spec_args(speculative_algorithm="EAGLE"), environ={}) == []
    assert settings(spec_args(speculative_num_draft_tokens=6), environ={}) == []


def test_untested_inject_kinds_are_refused_with_speculative_decoding_and_token_checks_are_not():
    tokens = CanaryConfig(mode="log", write_input_assert=True, token_check=True)
    assert settings(spec_args(), config=tokens) == []
    assert settings(spec_args(), inject=InjectSpec("wrong_position")) == [
        "--kv-canary-inject wrong_position with --speculative-algorithm EAGLE3"]


def test_the_accept_overcount_fault_needs_a_speculative_server_with_the_token_check():
    from jax_kvcanary.integrations.sglang_jax.server import refusals

    spec = InjectSpec("spec_accept_overcount")
    assert not spec.on_draft
    with pytest.raises(ValueError, match="cannot be aimed at the SWA group"):
        InjectSpec("spec_accept_overcount", group="SWA")
    base = {"dp_size": 1, "enable_lora": False}
    plain = types.SimpleNamespace(**{**vars(spec_args(speculative_algorithm=None)), **base})
    eagle = types.SimpleNamespace(**{**vars(spec_args()), **base})
    tokens = CanaryConfig(mode="log", token_check=True)
    assert [line for line in refusals(plain, tokens, spec) if "overcount" in line] == [
        "kv-canary: --kv-canary-inject spec_accept_overcount without --speculative-algorithm is "
        "not supported: that fault is planted in speculative decoding; add "
        "--speculative-algorithm EAGLE3 (or EAGLE)"]
    assert [line for line in refusals(eagle, LOG, spec) if "overcount" in line] == [
        "kv-canary: --kv-canary-inject spec_accept_overcount without --kv-canary-token-check is "
        "not supported: that fault is found by the token check; add --kv-canary-token-check"]


def test_a_verify_s_committed_tokens_are_recorded_at_the_positions_after_its_first():
    """Two live rows and a padding row, 4 draft tokens (3 steps): row 0 (pool row 5, first
    verified position 10) accepted 1 draft token (2 committed), row 1 (pool row 2, position 7)
    none (1 committed). Each commits the target's tokens at the positions after its first; the
    sampling path's one extra token at the end is not read."""
    positions = np.array([10, 11, 9, 9, 7, 9, 9, 9, 0, 0, 0, 0])      # gathered, accept order
    ids = np.array([101, 102, 103, 104, 201, 202, 203, 204, 0, 0, 0, 0, 999])
    cells = speculative.verified_cells(np.array([5, 2, -1]), positions, ids, np.array([2, 1, 1]),
                                       draft_tokens=4)
    assert sorted(map(tuple, cells.T.tolist())) == [(3, 8, 201), (6, 11, 101), (6, 12, 102)]


def test_the_token_mirror_makes_the_draft_positions_after_a_request_s_tokens_unknown():
    """With a lookahead, a request's extend sends its tokens, then that many unknown positions
    (what an earlier request on its pool row left there), and so does a verify's commit."""
    import jax

    from jax_kvcanary.integrations.sglang_jax.tokens import TokenMirror

    mesh = jax.make_mesh((1,), ("data",))
    mirror = TokenMirror(4, 16, mesh)
    mirror.commit(np.stack([np.full(16, 2), np.arange(16), np.full(16, 7)]))   # an earlier
    req = types.SimpleNamespace(req_pool_idx=1, fill_ids=[3, 4, 5], prefix_indices=[], rid="a")
    mirror.lookahead = 4
    for chunk in mirror.host_tokens([req]):
        mirror.pool = mirror._apply(mirror.pool, chunk)
    assert np.asarray(mirror.pool)[2, :9].tolist() == [3, 4, 5, -1, -1, -1, -1, 7, 7]
    mirror.commit(np.array([[2, 2], [3, 4], [8, 9]]))        # a verify committed 8, 9 at 3, 4
    assert np.asarray(mirror.pool)[2, :11].tolist() == [3, 4, 5, 8, 9, -1, -1, -1, -1, 7, 7]


class FakeSpecWorker:
    """sglang-jax's spec worker as the health check sees it: ``calls`` model calls per batch."""

    def __init__(self, canary, calls):
        self.canary, self.calls = canary, calls

    def forward_batch_speculative_generation(self, batch):
        self.canary.steps += self.calls
        return "result"

    def forward_batch_speculative_decode_overlap(self, batch):
        return "fused"


def test_a_fault_aimed_at_the_draft_pool_needs_a_draft_model_and_a_kind_that_can_go_there():
    from jax_kvcanary.integrations.sglang_jax.server import refusals

    assert InjectSpec("real_kv_used", group="DRAFT").on_draft
    with pytest.raises(ValueError, match="wrong_position cannot be aimed at the draft model's "
                                         "pool .* use real_kv_used"):
        InjectSpec("wrong_position", group="DRAFT")
    plain = types.SimpleNamespace(**{**vars(spec_args(speculative_algorithm=None)), "dp_size": 1,
                                     "enable_lora": False})
    got = refusals(plain, LOG, InjectSpec("real_kv_used", group="DRAFT"))
    assert [line for line in got if "DRAFT" in line] == [
        "kv-canary: --kv-canary-inject-group DRAFT without --speculative-algorithm is not "
        "supported: there is no draft model; add --speculative-algorithm EAGLE3 (or EAGLE)"], got


def test_a_speculative_batch_without_a_model_call_the_canary_saw_ends_the_server():
    batch = types.SimpleNamespace(forward_mode=types.SimpleNamespace(name="DECODE"))
    for calls in (1, 0):
        canary = types.SimpleNamespace(steps=0)
        scheduler = types.SimpleNamespace(draft_worker=FakeSpecWorker(canary, calls))
        speculative.guard_spec_worker(scheduler, canary)
        worker = scheduler.draft_worker
        if calls:
            assert worker.forward_batch_speculative_generation(batch) == "result"
        else:
            with pytest.raises(CanaryHealthError, match="a speculative DECODE batch ran without a "
                                                        "target model call the canary saw"):
                worker.forward_batch_speculative_generation(batch)
        with pytest.raises(CanaryHealthError, match="forward_batch_speculative_decode_overlap, a "
                                                    "fused speculative path"):
            worker.forward_batch_speculative_decode_overlap(batch)


def test_a_speculative_batch_without_a_draft_model_call_the_draft_canary_saw_ends_the_server():
    batch = types.SimpleNamespace(forward_mode=types.SimpleNamespace(name="EXTEND"))
    target, draft = types.SimpleNamespace(steps=0), types.SimpleNamespace(steps=0)
    scheduler = types.SimpleNamespace(draft_worker=FakeSpecWorker(target, 1))
    speculative.guard_spec_worker(scheduler, target, draft)
    with pytest.raises(CanaryHealthError, match="a speculative EXTEND batch ran without a draft "
                                                "model call the canary saw"):
        scheduler.draft_worker.forward_batch_speculative_generation(batch)


def verify_arrays(page_size):
    """A TARGET_VERIFY step of two requests, 4 tokens each, as the fa metadata has it: request 0
    has 5 committed tokens (KV length 9), request 1 has 2 (KV length 6); a padding row."""
    if page_size == 1:
        pages = np.array([11, 12, 13, 14, 15, 16, 17, 18, 19, 31, 32, 33, 34, 35, 36, 0, 0],
                         np.int32)
        slots0, slots1 = [11, 12, 13, 14, 15, 16, 17, 18, 19], [31, 32, 33, 34, 35, 36]
    else:                                         # 4 slots per page: 9 -> 3 pages, 6 -> 2
        pages = np.array([2, 5, 3, 7, 8, 0], np.int32)
        slots0 = [8, 9, 10, 11, 20, 21, 22, 23, 12]
        slots1 = [28, 29, 30, 31, 32, 33]
    arrays = dict(req_pool_indices=np.array([4, 1, -1], np.int32),
                  seq_lens=np.array([9, 6, 0], np.int32), cu_q_lens=np.array([0, 4, 8, 8], np.int32),
                  cu_kv_lens=np.cumsum([0, 9, 6, 0] if page_size == 1 else [0, 12, 8, 0],
                                       dtype=np.int32),
                  page_indices=pages, cache_loc=None, extend_prefix_lens=None, extend_seq_lens=None,
                  input_ids=np.arange(100, 112, dtype=np.int32),
                  positions=np.array([5, 6, 7, 8, 2, 3, 4, 5, -1, 0, 1, 2], np.int32),
                  out_cache_loc=None)
    return arrays, slots0, slots1


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_verify_step_is_planned_from_what_the_fa_kernel_reads_and_writes(page_size):
    import jax

    arrays, slots0, slots1 = verify_arrays(page_size)
    mesh = jax.make_mesh((1,), ("data",))
    b = layout.page_table_batch({k: None if v is None else jnp.asarray(v)
                                 for k, v in arrays.items()},
                                decode=False, page_size=page_size, aligned=True, mesh=mesh)
    assert b.prefix_lens.tolist() == [5, 2, 0] and b.extend_seq_lens.tolist() == [4, 4, 0]
    starts = b.req_to_token_row_starts.tolist()
    table = np.asarray(b.req_to_token)
    assert table[starts[0]:starts[0] + 9].tolist() == slots0
    assert table[starts[1]:starts[1] + 6].tolist() == slots1
    # each new token is written where the page table has its KV position
    assert b.out_cache_loc.tolist() == slots0[5:] + slots1[2:] + [-1] * 4
    assert layout.table_entries(arrays, page_size) == table.shape[0]


def test_a_verify_s_rows_name_the_request_that_wrote_or_read_the_slot():
    arrays, slots0, slots1 = verify_arrays(1)
    # a write row (write_position) on request 1's new token at KV position 3, and a verify row
    # (verify_position: the row holds the slot's stored position, 7) on request 0's prefix slot
    # read at position 2 (docs/format.md §5: tag, slot, position, ..., fail bits in column 7)
    from jax_kvcanary.consts import FailReason, LaunchTag
    head = int(LaunchTag.HEAD_K_FULL)
    rows = np.zeros((2, 8), np.int64)
    rows[0, :3], rows[0, 7] = (head, slots1[3], 3), int(FailReason.WRITE_POSITION_MISMATCH)
    rows[1, :3], rows[1, 7] = (head, slots0[2], 7), int(FailReason.VERIFY_POSITION_MISMATCH)
    named = named_batch_rows(rows, arrays, decode=False, page_size=1, aligned=True)
    assert named == {1: [0], 0: [1]}, named


def draft_decode_arrays():
    """A draft model's DECODE step as sglang-jax runs it: its batch arrays are placeholders, the fa
    metadata has one new token per row (padding rows too), and the draft's input positions are
    one past the KV position the kernel writes (KV position 9 of request 0 gets position 10)."""
    pages = np.array([11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 31, 32, 33, 34, 0, 0], np.int32)
    return dict(req_pool_indices=np.array([4, 1, -1, -1], np.int32),
                seq_lens=np.array([10, 4, 0, 0], np.int32),
                cu_q_lens=np.array([0, 1, 2, 3, 4], np.int32),
                cu_kv_lens=np.array([0, 10, 14, 14, 14], np.int32), page_indices=pages,
                cache_loc=None, extend_prefix_lens=None, extend_seq_lens=None,
                input_ids=np.array([7, 8, 0, 0], np.int32),
                positions=np.array([10, 4, 1, 1], np.int32), out_cache_loc=None)


def test_a_draft_step_records_each_token_at_the_kv_position_it_is_written_to():
    import jax

    arrays = draft_decode_arrays()
    mesh = jax.make_mesh((1,), ("data",))
    dev = {k: None if v is None else jnp.asarray(v) for k, v in arrays.items()}
    b = layout.page_table_batch(dev, decode=False, page_size=1, aligned=True, mesh=mesh,
                                kv_positions=True)
    assert b.prefix_lens.tolist() == [9, 3, 0, 0] and b.extend_seq_lens.tolist() == [1, 1, 0, 0]
    # the padding rows' tokens are written nowhere; the live ones at their rows' last KV position
    assert b.out_cache_loc.tolist() == [20, 34, -1, -1]
    assert b.positions.tolist()[:2] == [9, 3]
    target = layout.page_table_batch(dev, decode=False, page_size=1, aligned=True, mesh=mesh)
    assert target.positions.tolist() == [10, 4, 1, 1]          # the input positions otherwise


def test_a_draft_step_s_write_row_names_the_request_that_wrote_at_that_kv_position():
    """The draft canary's rows hold KV positions: a write row on request 1's new token (slot 34,
    KV position 3; input position 4) names batch row 1 when read as the draft's, and no row
    when read with input positions (as the target's would be)."""
    from jax_kvcanary.consts import FailReason, LaunchTag
    rows = np.zeros((1, 8), np.int64)
    rows[0, :3] = (int(LaunchTag.HEAD_K_FULL), 34, 3)
    rows[0, 7] = int(FailReason.WRITE_TOKEN_MISMATCH)
    kw = dict(decode=False, page_size=1, aligned=True)
    assert named_batch_rows(rows, draft_decode_arrays(), kv_positions=True, **kw) == {1: [0]}
    assert named_batch_rows(rows, draft_decode_arrays(), **kw) == {}


def draft_extend_batch(pages):
    """A DRAFT_EXTEND of two requests (4 entries each; KV lengths 9 and 6) as the injector sees
    it: the batch's placeholders and its fa metadata."""
    md = types.SimpleNamespace(seq_lens=np.array([9, 6, 0], np.int32),
                               cu_q_lens=np.array([0, 4, 8, 8], np.int32),
                               cu_kv_lens=np.array([0, 9, 15, 15], np.int32),
                               page_indices=jnp.asarray(pages))
    mode = types.SimpleNamespace(is_target_verify=lambda: False, is_decode=lambda: False,
                                 is_draft_extend=lambda: True)
    return types.SimpleNamespace(
        forward_mode=mode, attn_backend=types.SimpleNamespace(forward_metadata=md),
        req_pool_indices=np.array([4, 1, -1], np.int32), seq_lens=np.array([9, 6, 0], np.int32),
        extend_prefix_lens=None, extend_seq_lens=None, cache_loc=np.empty((1,)),
        input_ids=np.arange(12, dtype=np.int32), positions=np.zeros(12, np.int32),
        out_cache_loc=np.empty((1,)))


@pytest.mark.parametrize("kind, moved", [
    # row 0's last entry (KV position 8, table index 8) now writes row 1's prefix slot at its
    # position 1 (table index 9 + 1)
    ("spec_rejected_foreign_write", {8: 32}),
    # row 0's first page (table index 0) now past the draft pool of 64 slots
    ("draft_pool_short", {0: 64}),
    # aimed at the draft (--kv-canary-inject-group DRAFT): row 0's first two pages swapped
    ("req_to_token_swap", {0: 12, 1: 11}),
])
def test_a_draft_fault_changes_the_draft_step_s_page_table(kind, moved):
    from jax_kvcanary.integrations.sglang_jax.inject import FaultInjector

    pages = np.array([11, 12, 13, 14, 15, 16, 17, 18, 19, 31, 32, 33, 34, 35, 36, 0], np.int32)
    canary = types.SimpleNamespace(config=LOG, draft=True, steps=6, num_slots=64,
                                   layout=types.SimpleNamespace(page_size=1, groups=("FULL",)))
    injector = FaultInjector(InjectSpec(kind, step=6, group="DRAFT"), canary, scheduler=None)
    fb = draft_extend_batch(pages)
    injector.before_step(fb)
    want = pages.copy()
    for at, page in moved.items():
        want[at] = page
    assert np.asarray(fb.attn_backend.forward_metadata.page_indices).tolist() == want.tolist()
    assert injector.done


def test_the_foreign_write_is_refused_above_page_size_1():
    from jax_kvcanary.integrations.sglang_jax.inject import FaultInjector

    canary = types.SimpleNamespace(config=LOG, draft=True, steps=0, num_slots=64,
                                   layout=types.SimpleNamespace(page_size=4, groups=("FULL",)))
    with pytest.raises(ValueError, match="spec_rejected_foreign_write needs --page-size 1"):
        FaultInjector(InjectSpec("spec_rejected_foreign_write"), canary, scheduler=None)
    with pytest.raises(ValueError, match="cannot be aimed at the SWA group"):
        InjectSpec("draft_pool_short", group="SWA")
    assert InjectSpec("draft_pool_short").on_draft and not InjectSpec("real_kv_used").on_draft
