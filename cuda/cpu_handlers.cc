// cpu_handlers.cc: XLA FFI handlers for the CPU platform. Each handler is a loop over the shared
// per-entry functions of canary_core.h, in (request, entry) order, appending rows as it goes.
// No handler returns an error for data: every argument check is done in Python at trace time.
#include <cstring>

#include "canary_core.h"
#include "cpu_handlers.h"
#include "ffi_common.h"

namespace kvcanary {
namespace {

// Results are aliased to their inputs; copy only if XLA ever hands us distinct buffers.
void alias_in(const ffi::AnyBuffer& in, ffi::Result<ffi::AnyBuffer>& out) {
  if (out->untyped_data() != in.untyped_data() && in.size_bytes() == out->size_bytes())
    std::memcpy(out->untyped_data(), in.untyped_data(), in.size_bytes());
}

struct LogBuffers {
  uint8_t* ring;
  int64_t capacity;
  int32_t* write_index;
  uint8_t* kernel_counters;
  uint8_t* slot_counters;
};

ffi::Error VerifyCpu(ffi::AnyBuffer canary, ffi::AnyBuffer ring, ffi::AnyBuffer write_index,
                     ffi::AnyBuffer kernel_counters, ffi::AnyBuffer slot_counters, ffi::AnyBuffer slots,
                     ffi::AnyBuffer tokens, ffi::AnyBuffer positions, ffi::AnyBuffer prevs,
                     ffi::AnyBuffer num_valid, ffi::AnyBuffer enable, ffi::RemainingArgs srcs,
                     ffi::Result<ffi::AnyBuffer> ring_out, ffi::Result<ffi::AnyBuffer> write_index_out,
                     ffi::Result<ffi::AnyBuffer> kernel_counters_out, ffi::Result<ffi::AnyBuffer> slot_counters_out,
                     int64_t tag, bool check_token, int32_t mode, ffi::Span<const int64_t> page_size,
                     ffi::Span<const int64_t> bytes_per_token, ffi::Span<const int64_t> read_bytes) {
  alias_in(ring, ring_out);
  alias_in(write_index, write_index_out);
  alias_in(kernel_counters, kernel_counters_out);
  alias_in(slot_counters, slot_counters_out);
  uint8_t* kc = static_cast<uint8_t*>(kernel_counters_out->untyped_data());
  uint8_t* sc = static_cast<uint8_t*>(slot_counters_out->untyped_data());
  int32_t* wi = static_cast<int32_t*>(write_index_out->untyped_data());

  counter_add(kc, tag, 1);
  if (static_cast<const int32_t*>(enable.untyped_data())[0] == 0) return ffi::Error::Success();
  const int64_t active = verify_active(static_cast<const int32_t*>(num_valid.untyped_data())[0], dim_or_zero(slots, 0));
  counter_add(sc, tag, active);

  VerifyArgs a{};
  a.canary = canary_view(canary);
  a.slots = index_view(slots);
  a.tokens = index_view(tokens);
  a.positions = index_view(positions);
  a.prevs = index_view(prevs);
  a.check_token = check_token;
  a.sources = real_kv_sources(srcs, mode, page_size, bytes_per_token, read_bytes);
  a.tag = tag;
  RingAppender emit{static_cast<uint8_t*>(ring_out->untyped_data()), dim_or_zero(ring, 0), wi[0]};
  for (int64_t e = 0; e < active; ++e) verify_entry(a, e, emit);
  if (emit.count) wi[0] = next_write_index(emit.base, emit.count);
  return ffi::Error::Success();
}

ffi::Error WriteCpu(ffi::AnyBuffer canary, ffi::AnyBuffer ring, ffi::AnyBuffer write_index,
                    ffi::AnyBuffer kernel_counters, ffi::AnyBuffer slot_counters, ffi::AnyBuffer chain_flag,
                    ffi::AnyBuffer offsets, ffi::AnyBuffer seeds, ffi::AnyBuffer num_valid_reqs,
                    ffi::AnyBuffer input_ids, ffi::AnyBuffer positions, ffi::AnyBuffer locs,
                    ffi::AnyBuffer exp_tokens, ffi::AnyBuffer exp_positions, ffi::RemainingArgs srcs,
                    ffi::Result<ffi::AnyBuffer> canary_out, ffi::Result<ffi::AnyBuffer> ring_out,
                    ffi::Result<ffi::AnyBuffer> write_index_out, ffi::Result<ffi::AnyBuffer> kernel_counters_out,
                    ffi::Result<ffi::AnyBuffer> slot_counters_out, int64_t tag, bool input_assert, int32_t mode,
                    ffi::Span<const int64_t> page_size, ffi::Span<const int64_t> bytes_per_token,
                    ffi::Span<const int64_t> read_bytes) {
  alias_in(canary, canary_out);
  alias_in(ring, ring_out);
  alias_in(write_index, write_index_out);
  alias_in(kernel_counters, kernel_counters_out);
  alias_in(slot_counters, slot_counters_out);
  uint8_t* kc = static_cast<uint8_t*>(kernel_counters_out->untyped_data());
  uint8_t* sc = static_cast<uint8_t*>(slot_counters_out->untyped_data());
  int32_t* wi = static_cast<int32_t*>(write_index_out->untyped_data());
  counter_add(kc, tag, 1);

  const int64_t n_tokens = dim_or_zero(input_ids, 0);
  const int64_t capacity = dim_or_zero(seeds, 0);
  const int64_t active = write_active(static_cast<const int32_t*>(num_valid_reqs.untyped_data())[0], capacity);

  WriteArgs a{};
  a.canary = canary_view(*canary_out);
  a.seeds = index_view(seeds);
  a.input_ids = index_view(input_ids);
  a.positions = index_view(positions);
  a.locs = index_view(locs);
  a.exp_tokens = index_view(exp_tokens);
  a.exp_positions = index_view(exp_positions);
  a.input_assert = input_assert_usable(input_assert, exp_tokens, exp_positions, n_tokens);
  a.chain_assert = static_cast<const int32_t*>(chain_flag.untyped_data())[0] != 0;
  a.sources = real_kv_sources(srcs, mode, page_size, bytes_per_token, read_bytes);
  a.tag = tag;

  const IndexView off = index_view(offsets);
  RingAppender emit{static_cast<uint8_t*>(ring_out->untyped_data()), dim_or_zero(ring, 0), wi[0]};
  int64_t running_max = off[0];
  int64_t lo = clamp_offset(running_max, n_tokens);
  int64_t written = 0;
  for (int64_t r = 0; r < active; ++r) {
    const int64_t next = off[r + 1];
    if (next > running_max) running_max = next;
    const int64_t hi = clamp_offset(running_max, n_tokens);
    written += write_request(a, r, lo, hi, emit);
    lo = hi;
  }
  counter_add(sc, tag, written);
  if (emit.count) wi[0] = next_write_index(emit.base, emit.count);
  return ffi::Error::Success();
}

ffi::Error PlanCpu(ffi::AnyBuffer rpi, ffi::AnyBuffer prefix, ffi::AnyBuffer extend, ffi::AnyBuffer r2t,
                   ffi::AnyBuffer lut, ffi::AnyBuffer pool, ffi::AnyBuffer valid_lens,
                   ffi::Result<ffi::Buffer<ffi::S32>> v_slots, ffi::Result<ffi::Buffer<ffi::S32>> v_tokens,
                   ffi::Result<ffi::Buffer<ffi::S32>> v_positions, ffi::Result<ffi::Buffer<ffi::S32>> v_prevs,
                   ffi::Result<ffi::Buffer<ffi::S32>> v_num_valid, ffi::Result<ffi::Buffer<ffi::S32>> v_enable,
                   ffi::Result<ffi::Buffer<ffi::S32>> w_offsets, ffi::Result<ffi::Buffer<ffi::S32>> w_seeds,
                   ffi::Result<ffi::Buffer<ffi::S32>> w_num_valid_reqs, int64_t window, int64_t token_offset,
                   bool has_lut, bool has_pool) {
  const PlanArgs a = plan_args(rpi, prefix, extend, r2t, lut, pool, valid_lens, window, token_offset, has_lut, has_pool);
  const int64_t bs = dim_or_zero(rpi, 0);
  const int64_t vcap = v_slots->element_count();
  const int64_t wcap = w_seeds->element_count();
  int32_t* slots = v_slots->typed_data();
  int32_t* tokens = v_tokens->typed_data();
  int32_t* positions = v_positions->typed_data();
  int32_t* prevs = v_prevs->typed_data();
  int32_t* offsets = w_offsets->typed_data();
  int32_t* seeds = w_seeds->typed_data();
  std::memset(slots, 0, vcap * sizeof(int32_t));
  std::memset(tokens, 0, vcap * sizeof(int32_t));
  std::memset(positions, 0, vcap * sizeof(int32_t));
  std::memset(prevs, 0, vcap * sizeof(int32_t));
  std::memset(offsets, 0, (wcap + 1) * sizeof(int32_t));
  std::memset(seeds, 0, wcap * sizeof(int32_t));

  int64_t total = 0;
  int64_t write_total = 0;
  for (int64_t r = 0; r < bs && r < wcap; ++r) {
    const PlanRow row = plan_row(a, r);
    total = add_wrap(total, row.vlen);
    write_total = add_wrap(write_total, row.wlen);
    offsets[r + 1] = static_cast<int32_t>(write_total);
    seeds[r] = static_cast<int32_t>(row.seed);
  }
  const bool enable = total <= vcap;
  if (enable) {
    int64_t flat = 0;
    for (int64_t r = 0; r < bs && flat < vcap; ++r) {
      const PlanRow row = plan_row(a, r);
      for (int64_t j = 0; j < row.vlen && flat < vcap; ++j, ++flat) {
        const PlanEntry e = plan_entry(a, row, r, j);
        slots[flat] = static_cast<int32_t>(e.slot);
        tokens[flat] = static_cast<int32_t>(e.token);
        positions[flat] = static_cast<int32_t>(e.position);
        prevs[flat] = static_cast<int32_t>(e.prev);
      }
    }
  }
  v_num_valid->typed_data()[0] = static_cast<int32_t>(total < vcap ? total : vcap);
  v_enable->typed_data()[0] = enable ? 1 : 0;
  w_num_valid_reqs->typed_data()[0] = static_cast<int32_t>(bs);
  return ffi::Error::Success();
}

template <typename T>
void scatter_rows(T* pool, int64_t Rp, int64_t Cp, IndexView flat, int64_t total, IndexView offsets, IndexView rpi,
                  int64_t bs) {
  for (int64_t r = 0; r < bs; ++r) {
    const int64_t start = offsets[r];
    const int64_t rp = rpi[r];
    const int64_t n = scatter_row_len(start, offsets[r + 1], rp, Rp, Cp);
    for (int64_t c = 0; c < n; ++c) {
      const int64_t src = add_wrap(start, c);
      if (src >= 0 && src < total) pool[rp * Cp + c] = static_cast<T>(flat[src]);
    }
  }
}

ffi::Error ScatterCpu(ffi::AnyBuffer pool, ffi::AnyBuffer flat_ids, ffi::AnyBuffer offsets, ffi::AnyBuffer rpi,
                      ffi::Result<ffi::AnyBuffer> pool_out) {
  alias_in(pool, pool_out);
  const int64_t Rp = dim_or_zero(pool, 0), Cp = dim_or_zero(pool, 1);
  const int64_t bs = dim_or_zero(rpi, 0);
  if (pool.element_type() == ffi::DataType::S64) {
    scatter_rows(static_cast<int64_t*>(pool_out->untyped_data()), Rp, Cp, index_view(flat_ids),
                 dim_or_zero(flat_ids, 0), index_view(offsets), index_view(rpi), bs);
  } else {
    scatter_rows(static_cast<int32_t*>(pool_out->untyped_data()), Rp, Cp, index_view(flat_ids),
                 dim_or_zero(flat_ids, 0), index_view(offsets), index_view(rpi), bs);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kvcanary_verify_cpu, VerifyCpu, KVCANARY_VERIFY_BINDING());
XLA_FFI_DEFINE_HANDLER_SYMBOL(kvcanary_write_cpu, WriteCpu, KVCANARY_WRITE_BINDING());
XLA_FFI_DEFINE_HANDLER_SYMBOL(kvcanary_plan_cpu, PlanCpu, KVCANARY_PLAN_BINDING());
XLA_FFI_DEFINE_HANDLER_SYMBOL(kvcanary_scatter_cpu, ScatterCpu, KVCANARY_SCATTER_BINDING());

}  // namespace kvcanary
