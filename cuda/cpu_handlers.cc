// cpu_handlers.cc: XLA FFI handlers for the CPU platform: buffers -> core views, then the
// sequential launchers of cpu_loops.h (loops over canary_core.h in (request, entry) order).
// No handler returns an error for data: every argument check is done in Python at trace time.
#include <cstring>

#include "canary_core.h"
#include "cpu_handlers.h"
#include "cpu_loops.h"
#include "ffi_common.h"

namespace kvcanary {
namespace {

// Results are aliased to their inputs; copy only if XLA ever hands us distinct buffers.
void alias_in(const ffi::AnyBuffer& in, ffi::Result<ffi::AnyBuffer>& out) {
  if (out->untyped_data() != in.untyped_data() && in.size_bytes() == out->size_bytes())
    std::memcpy(out->untyped_data(), in.untyped_data(), in.size_bytes());
}

LogView log_view(ffi::Result<ffi::AnyBuffer>& ring, ffi::Result<ffi::AnyBuffer>& write_index,
                 ffi::Result<ffi::AnyBuffer>& kernel_counters, ffi::Result<ffi::AnyBuffer>& slot_counters) {
  return LogView{static_cast<uint8_t*>(ring->untyped_data()), dim_or_zero(*ring, 0),
                 static_cast<int32_t*>(write_index->untyped_data()),
                 static_cast<uint8_t*>(kernel_counters->untyped_data()),
                 static_cast<uint8_t*>(slot_counters->untyped_data())};
}

int32_t scalar_i32(const ffi::AnyBuffer& b) { return static_cast<const int32_t*>(b.untyped_data())[0]; }

ffi::Error VerifyCpu(ffi::AnyBuffer canary, ffi::AnyBuffer ring, ffi::AnyBuffer write_index,
                     ffi::AnyBuffer kernel_counters, ffi::AnyBuffer slot_counters, ffi::AnyBuffer slots,
                     ffi::AnyBuffer tokens, ffi::AnyBuffer positions, ffi::AnyBuffer prevs,
                     ffi::AnyBuffer num_valid, ffi::AnyBuffer enable, ffi::RemainingArgs srcs,
                     ffi::Result<ffi::AnyBuffer> ring_out, ffi::Result<ffi::AnyBuffer> write_index_out,
                     ffi::Result<ffi::AnyBuffer> kernel_counters_out, ffi::Result<ffi::AnyBuffer> slot_counters_out,
                     ffi::Result<ffi::AnyBuffer> /*scratch: CUDA only*/, int64_t tag, bool check_token, int32_t mode, ffi::Span<const int64_t> page_size,
                     ffi::Span<const int64_t> bytes_per_token, ffi::Span<const int64_t> read_bytes) {
  alias_in(ring, ring_out);
  alias_in(write_index, write_index_out);
  alias_in(kernel_counters, kernel_counters_out);
  alias_in(slot_counters, slot_counters_out);
  VerifyArgs a{};
  a.canary = canary_view(canary);
  a.slots = index_view(slots);
  a.tokens = index_view(tokens);
  a.positions = index_view(positions);
  a.prevs = index_view(prevs);
  a.check_token = check_token;
  a.sources = real_kv_sources(srcs, mode, page_size, bytes_per_token, read_bytes);
  a.tag = tag;
  verify_launch(a, dim_or_zero(slots, 0), scalar_i32(num_valid), scalar_i32(enable),
                log_view(ring_out, write_index_out, kernel_counters_out, slot_counters_out));
  return ffi::Error::Success();
}

ffi::Error WriteCpu(ffi::AnyBuffer canary, ffi::AnyBuffer ring, ffi::AnyBuffer write_index,
                    ffi::AnyBuffer kernel_counters, ffi::AnyBuffer slot_counters, ffi::AnyBuffer chain_flag,
                    ffi::AnyBuffer offsets, ffi::AnyBuffer seeds, ffi::AnyBuffer num_valid_reqs,
                    ffi::AnyBuffer input_ids, ffi::AnyBuffer positions, ffi::AnyBuffer locs,
                    ffi::AnyBuffer exp_tokens, ffi::AnyBuffer exp_positions, ffi::RemainingArgs srcs,
                    ffi::Result<ffi::AnyBuffer> canary_out, ffi::Result<ffi::AnyBuffer> ring_out,
                    ffi::Result<ffi::AnyBuffer> write_index_out, ffi::Result<ffi::AnyBuffer> kernel_counters_out,
                    ffi::Result<ffi::AnyBuffer> slot_counters_out, ffi::Result<ffi::AnyBuffer> /*scratch: CUDA only*/,
                    int64_t tag, bool input_assert, int32_t mode,
                    ffi::Span<const int64_t> page_size, ffi::Span<const int64_t> bytes_per_token,
                    ffi::Span<const int64_t> read_bytes) {
  alias_in(canary, canary_out);
  alias_in(ring, ring_out);
  alias_in(write_index, write_index_out);
  alias_in(kernel_counters, kernel_counters_out);
  alias_in(slot_counters, slot_counters_out);
  const int64_t n_tokens = dim_or_zero(input_ids, 0);
  WriteArgs a{};
  a.canary = canary_view(*canary_out);
  a.seeds = index_view(seeds);
  a.input_ids = index_view(input_ids);
  a.positions = index_view(positions);
  a.locs = index_view(locs);
  a.exp_tokens = index_view(exp_tokens);
  a.exp_positions = index_view(exp_positions);
  a.input_assert = input_assert_usable(input_assert, exp_tokens, exp_positions, n_tokens);
  a.chain_assert = scalar_i32(chain_flag) != 0;
  a.sources = real_kv_sources(srcs, mode, page_size, bytes_per_token, read_bytes);
  a.tag = tag;
  write_launch(a, index_view(offsets), dim_or_zero(seeds, 0), scalar_i32(num_valid_reqs), n_tokens,
               log_view(ring_out, write_index_out, kernel_counters_out, slot_counters_out));
  return ffi::Error::Success();
}

ffi::Error PlanCpu(ffi::AnyBuffer rpi, ffi::AnyBuffer prefix, ffi::AnyBuffer extend, ffi::AnyBuffer r2t,
                   ffi::AnyBuffer lut, ffi::AnyBuffer pool, ffi::AnyBuffer valid_lens,
                   ffi::Result<ffi::Buffer<ffi::S32>> v_slots, ffi::Result<ffi::Buffer<ffi::S32>> v_tokens,
                   ffi::Result<ffi::Buffer<ffi::S32>> v_positions, ffi::Result<ffi::Buffer<ffi::S32>> v_prevs,
                   ffi::Result<ffi::Buffer<ffi::S32>> v_num_valid, ffi::Result<ffi::Buffer<ffi::S32>> v_enable,
                   ffi::Result<ffi::Buffer<ffi::S32>> w_offsets, ffi::Result<ffi::Buffer<ffi::S32>> w_seeds,
                   ffi::Result<ffi::Buffer<ffi::S32>> w_num_valid_reqs, ffi::Result<ffi::AnyBuffer> /*scratch: CUDA only*/,
                   int64_t window, int64_t token_offset, bool has_lut, bool has_pool) {
  const PlanArgs a = plan_args(rpi, prefix, extend, r2t, lut, pool, valid_lens, window, token_offset, has_lut, has_pool);
  const PlanOut out{v_slots->typed_data(), v_tokens->typed_data(), v_positions->typed_data(),
                    v_prevs->typed_data(), v_num_valid->typed_data(), v_enable->typed_data(),
                    w_offsets->typed_data(), w_seeds->typed_data(), w_num_valid_reqs->typed_data()};
  plan_launch(a, dim_or_zero(rpi, 0), static_cast<int64_t>(v_slots->element_count()),
              static_cast<int64_t>(w_seeds->element_count()), out);
  return ffi::Error::Success();
}

ffi::Error ScatterCpu(ffi::AnyBuffer pool, ffi::AnyBuffer flat_ids, ffi::AnyBuffer offsets, ffi::AnyBuffer rpi,
                      ffi::Result<ffi::AnyBuffer> pool_out) {
  alias_in(pool, pool_out);
  const int64_t Rp = dim_or_zero(pool, 0), Cp = dim_or_zero(pool, 1);
  const int64_t bs = dim_or_zero(rpi, 0);
  if (pool.element_type() == ffi::DataType::S64) {
    scatter_launch(static_cast<int64_t*>(pool_out->untyped_data()), Rp, Cp, index_view(flat_ids),
                   dim_or_zero(flat_ids, 0), index_view(offsets), index_view(rpi), bs);
  } else {
    scatter_launch(static_cast<int32_t*>(pool_out->untyped_data()), Rp, Cp, index_view(flat_ids),
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
