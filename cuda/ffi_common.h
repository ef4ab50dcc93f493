// ffi_common.h: XLA FFI glue shared by the CPU and CUDA handlers: buffer -> core view conversion and
// the handler bindings (one signature per op, identical on both platforms).
#pragma once

#include <cstdint>

#include "canary_core.h"
#include "xla/ffi/api/ffi.h"

namespace kvcanary {
namespace ffi = ::xla::ffi;

inline IndexView index_view(const ffi::AnyBuffer& b) {
  return IndexView{b.untyped_data(), b.element_type() == ffi::DataType::S64};
}

inline int64_t dim_or_zero(const ffi::AnyBuffer& b, size_t d) {
  auto dims = b.dimensions();
  return d < dims.size() ? dims[d] : 0;
}

// Real-KV sources: buffers from RemainingArgs, geometry from static attributes. Rows and row bytes
// come from the buffer itself, so they cannot disagree with what is mapped. A source whose geometry
// would reach past its row (never produced by the Python checks) is treated as having no rows, so no
// byte outside a buffer is ever read (make_source_view in canary_core.h).
inline RealKvSources real_kv_sources(const ffi::RemainingArgs& srcs, int32_t mode,
                                     ffi::Span<const int64_t> page_size,
                                     ffi::Span<const int64_t> bytes_per_token,
                                     ffi::Span<const int64_t> read_bytes) {
  RealKvSources out{};
  out.mode = mode;
  out.count = 0;
  const size_t n = srcs.size() < static_cast<size_t>(MAX_REAL_KV_SOURCES) ? srcs.size() : MAX_REAL_KV_SOURCES;
  for (size_t k = 0; k < n; ++k) {
    auto buf = srcs.get<ffi::AnyBuffer>(k);
    if (!buf.has_value() || k >= page_size.size() || k >= bytes_per_token.size() || k >= read_bytes.size()) break;
    const int64_t rows = dim_or_zero(*buf, 0);
    const int64_t row_bytes = rows > 0 ? static_cast<int64_t>(buf->size_bytes()) / rows : 0;
    out.src[out.count++] = make_source_view(static_cast<const uint8_t*>(buf->untyped_data()), rows, row_bytes,
                                            page_size[k], bytes_per_token[k], read_bytes[k], mode);
  }
  if (out.count == 0) out.mode = static_cast<int32_t>(RealKvHashMode::NONE);
  if (out.mode == static_cast<int32_t>(RealKvHashMode::NONE)) out.count = 0;
  return out;
}

inline CanaryView canary_view(const ffi::AnyBuffer& b) {
  return CanaryView{static_cast<uint8_t*>(b.untyped_data()), dim_or_zero(b, 0), dim_or_zero(b, 1)};
}

// Bindings. Argument order, result order and attribute names are the contract with jax_kvcanary/_ffi.py.
// verify, write and plan end their results with `scratch` (uint8[n]): device scratch of the CUDA
// handler, sized by cuda_scratch.h (n = 0 without the CUDA module); the CPU handlers ignore it.
//
// kvcanary_verify(canary, ring, write_index, kernel_counters, slot_counters,
//                 slot_indices, expected_tokens, expected_positions, prev_slot_indices, num_valid, enable,
//                 *sources) -> (ring, write_index, kernel_counters, slot_counters, scratch)
//   attrs: tag:i64, check_token:bool, mode:i32, page_size/bytes_per_token/read_bytes: i64[4]
#define KVCANARY_VERIFY_BINDING(...)             \
  ffi::Ffi::Bind()                               \
      __VA_ARGS__                                \
      .Arg<ffi::AnyBuffer>()                     \
      .Arg<ffi::AnyBuffer>()                     \
      .Arg<ffi::AnyBuffer>()                     \
      .Arg<ffi::AnyBuffer>()                     \
      .Arg<ffi::AnyBuffer>()                     \
      .Arg<ffi::AnyBuffer>()                     \
      .Arg<ffi::AnyBuffer>()                     \
      .Arg<ffi::AnyBuffer>()                     \
      .Arg<ffi::AnyBuffer>()                     \
      .Arg<ffi::AnyBuffer>()                     \
      .Arg<ffi::AnyBuffer>()                     \
      .RemainingArgs()                           \
      .Ret<ffi::AnyBuffer>()                     \
      .Ret<ffi::AnyBuffer>()                     \
      .Ret<ffi::AnyBuffer>()                     \
      .Ret<ffi::AnyBuffer>()                     \
      .Ret<ffi::AnyBuffer>()                     \
      .Attr<int64_t>("tag")                      \
      .Attr<bool>("check_token")                 \
      .Attr<int32_t>("mode")                     \
      .Attr<ffi::Span<const int64_t>>("page_size")       \
      .Attr<ffi::Span<const int64_t>>("bytes_per_token") \
      .Attr<ffi::Span<const int64_t>>("read_bytes")

// kvcanary_write(canary, ring, write_index, kernel_counters, slot_counters, chain_assert_flag,
//                offsets, seed_slot_indices, num_valid_reqs, input_ids, positions, out_cache_loc,
//                expected_tokens, expected_positions, *sources)
//   -> (canary, ring, write_index, kernel_counters, slot_counters, scratch)
//   attrs: tag:i64, input_assert:bool, mode:i32, page_size/bytes_per_token/read_bytes: i64[4]
#define KVCANARY_WRITE_BINDING(...)              \
  ffi::Ffi::Bind()                               \
      __VA_ARGS__                                \
      .Arg<ffi::AnyBuffer>()                     \
      .Arg<ffi::AnyBuffer>()                     \
      .Arg<ffi::AnyBuffer>()                     \
      .Arg<ffi::AnyBuffer>()                     \
      .Arg<ffi::AnyBuffer>()                     \
      .Arg<ffi::AnyBuffer>()                     \
      .Arg<ffi::AnyBuffer>()                     \
      .Arg<ffi::AnyBuffer>()                     \
      .Arg<ffi::AnyBuffer>()                     \
      .Arg<ffi::AnyBuffer>()                     \
      .Arg<ffi::AnyBuffer>()                     \
      .Arg<ffi::AnyBuffer>()                     \
      .Arg<ffi::AnyBuffer>()                     \
      .Arg<ffi::AnyBuffer>()                     \
      .RemainingArgs()                           \
      .Ret<ffi::AnyBuffer>()                     \
      .Ret<ffi::AnyBuffer>()                     \
      .Ret<ffi::AnyBuffer>()                     \
      .Ret<ffi::AnyBuffer>()                     \
      .Ret<ffi::AnyBuffer>()                     \
      .Ret<ffi::AnyBuffer>()                     \
      .Attr<int64_t>("tag")                      \
      .Attr<bool>("input_assert")                \
      .Attr<int32_t>("mode")                     \
      .Attr<ffi::Span<const int64_t>>("page_size")       \
      .Attr<ffi::Span<const int64_t>>("bytes_per_token") \
      .Attr<ffi::Span<const int64_t>>("read_bytes")

// kvcanary_plan(req_pool_indices, prefix_lens, extend_seq_lens, req_to_token, lut, pool, valid_lens)
//   -> (slot_indices, expected_tokens, expected_positions, prev_slot_indices, num_valid, enable,
//       offsets, seed_slot_indices, num_valid_reqs, scratch)   all int32 but scratch
//   attrs: window:i64, token_offset:i64, has_lut:bool, has_pool:bool
#define KVCANARY_PLAN_BINDING(...)               \
  ffi::Ffi::Bind()                               \
      __VA_ARGS__                                \
      .Arg<ffi::AnyBuffer>()                     \
      .Arg<ffi::AnyBuffer>()                     \
      .Arg<ffi::AnyBuffer>()                     \
      .Arg<ffi::AnyBuffer>()                     \
      .Arg<ffi::AnyBuffer>()                     \
      .Arg<ffi::AnyBuffer>()                     \
      .Arg<ffi::AnyBuffer>()                     \
      .Ret<ffi::Buffer<ffi::S32>>()              \
      .Ret<ffi::Buffer<ffi::S32>>()              \
      .Ret<ffi::Buffer<ffi::S32>>()              \
      .Ret<ffi::Buffer<ffi::S32>>()              \
      .Ret<ffi::Buffer<ffi::S32>>()              \
      .Ret<ffi::Buffer<ffi::S32>>()              \
      .Ret<ffi::Buffer<ffi::S32>>()              \
      .Ret<ffi::Buffer<ffi::S32>>()              \
      .Ret<ffi::Buffer<ffi::S32>>()              \
      .Ret<ffi::AnyBuffer>()                     \
      .Attr<int64_t>("window")                   \
      .Attr<int64_t>("token_offset")             \
      .Attr<bool>("has_lut")                     \
      .Attr<bool>("has_pool")

// kvcanary_scatter(pool, flat_ids, offsets, req_pool_indices) -> (pool)
#define KVCANARY_SCATTER_BINDING(...)            \
  ffi::Ffi::Bind()                               \
      __VA_ARGS__                                \
      .Arg<ffi::AnyBuffer>()                     \
      .Arg<ffi::AnyBuffer>()                     \
      .Arg<ffi::AnyBuffer>()                     \
      .Arg<ffi::AnyBuffer>()                     \
      .Ret<ffi::AnyBuffer>()

// Plan inputs -> core view.
inline PlanArgs plan_args(const ffi::AnyBuffer& rpi, const ffi::AnyBuffer& prefix, const ffi::AnyBuffer& extend,
                          const ffi::AnyBuffer& r2t, const ffi::AnyBuffer& lut, const ffi::AnyBuffer& pool,
                          const ffi::AnyBuffer& valid_lens, int64_t window, int64_t token_offset, bool has_lut,
                          bool has_pool) {
  PlanArgs a{};
  a.req_pool_indices = index_view(rpi);
  a.prefix_lens = index_view(prefix);
  a.extend_seq_lens = index_view(extend);
  a.req_to_token = index_view(r2t);
  a.R = dim_or_zero(r2t, 0);
  a.L = dim_or_zero(r2t, 1);
  a.has_lut = has_lut && dim_or_zero(lut, 0) > 0;
  a.lut = index_view(lut);
  a.lut_len = dim_or_zero(lut, 0);
  a.has_pool = has_pool && pool.dimensions().size() == 2;
  a.pool = index_view(pool);
  a.Rp = dim_or_zero(pool, 0);
  a.Cp = dim_or_zero(pool, 1);
  a.valid_lens = index_view(valid_lens);
  a.window = window;
  a.token_offset = token_offset;
  return a;
}

// The write-input-assert flag is honoured only when both expected arrays are as long as the inputs.
inline bool input_assert_usable(bool flag, const ffi::AnyBuffer& et, const ffi::AnyBuffer& ep, int64_t n) {
  return flag && dim_or_zero(et, 0) >= n && dim_or_zero(ep, 0) >= n;
}

}  // namespace kvcanary
