// ffi_handlers.h: the XLA FFI handler of each op, written once for both platforms.
//
// A handler binds the op's buffers and attributes (one signature per op, the contract with
// src/jax_kvcanary/_ffi.py), makes the aliased results hold their inputs, turns buffers into the
// core's argument structs (canary_core.h) and calls its platform's launcher. cpu_handlers.cc and
// cuda_handlers.cc instantiate the handlers with a Platform that supplies only what differs:
//
//   struct Platform {
//     using Context = ...;  // bound first: ffi::ThreadPool (CPU) or ffi::PlatformStream<cudaStream_t>
//     using Ctx = ...;      // what it decodes to (ffi::ThreadPool, cudaStream_t)
//     static ffi::Error copy(Ctx, void* dst, const void* src, size_t bytes);  // in-platform memcpy
//     static ffi::Error verify(Ctx, const VerifyArgs&, int64_t capacity, const int32_t* num_valid,
//                              const int32_t* enable, const LogView&, ScratchView);
//     static ffi::Error write(Ctx, const WriteArgs&, IndexView offsets, int64_t capacity, int64_t num_tokens,
//                             const int32_t* num_valid_reqs, const int32_t* chain_flag, const LogView&,
//                             ScratchView);
//     static ffi::Error plan(Ctx, const PlanArgs&, int64_t bs, int64_t vcap, int64_t wcap, const PlanOut&,
//                            ScratchView);
//     template <class T> static ffi::Error scatter(Ctx, T* pool, int64_t rows, int64_t cols,
//                                                  IndexView flat, int64_t total, IndexView offsets,
//                                                  IndexView req_pool_indices, int64_t bs);
//   };
//
// Pointers handed to a Platform are its own memory (host for CPU, device for CUDA): the int32[1]
// scalars (num_valid, enable, ...) are passed as pointers for that reason.
//
// Buffers whose dtype is fixed by the format (canary, log, plan scalars, plan outputs, scratch) are
// typed; index arrays are int32 or int64 (AnyBuffer, widened on read) and real-KV sources any dtype.
// No handler returns an error for anything Python could have checked (docs/design.md): the wrappers
// check every argument at trace time, so the only errors left are platform failures.
#pragma once

#include <cstdint>
#include <utility>

#include "canary_core.h"
#include "xla/ffi/api/ffi.h"

namespace kvcanary {
namespace ffi = ::xla::ffi;

using U8Array = ffi::Buffer<ffi::U8, 2>;   // canary [num_slots, stride], ring [cap, 64], counters [T, 8]
using I32Scalar = ffi::Buffer<ffi::S32, 1>;  // int32[1]
using U8ArrayOut = ffi::Result<U8Array>;
using I32ScalarOut = ffi::Result<I32Scalar>;
using I32VectorOut = ffi::Result<ffi::Buffer<ffi::S32, 1>>;
using ScratchOut = ffi::Result<ffi::Buffer<ffi::U8, 1>>;

// ---- buffers -> core views (the one place that converts them) --------------------------------
inline int64_t dim_or_zero(const ffi::AnyBuffer& b, size_t d) {
  auto dims = b.dimensions();
  return d < dims.size() ? dims[d] : 0;
}
template <ffi::DataType T, size_t R>
int64_t dim_or_zero(const ffi::Buffer<T, R>& b, size_t d) {
  auto dims = b.dimensions();
  return d < dims.size() ? dims[d] : 0;
}

inline IndexView index_view(const ffi::AnyBuffer& b) {
  return IndexView{b.untyped_data(), b.element_type() == ffi::DataType::S64};
}

inline CanaryView canary_view(const U8Array& b) {
  return CanaryView{b.typed_data(), dim_or_zero(b, 0), dim_or_zero(b, 1)};
}

inline LogView log_view(U8ArrayOut& ring, I32ScalarOut& write_index, U8ArrayOut& kernel_counters,
                        U8ArrayOut& slot_counters) {
  return LogView{ring->typed_data(), dim_or_zero(*ring, 0), write_index->typed_data(),
                 kernel_counters->typed_data(), slot_counters->typed_data()};
}

inline ScratchView scratch_view(ScratchOut& s) { return ScratchView{s->typed_data(), s->size_bytes()}; }

// Real-KV sources: buffers from RemainingArgs, geometry from static attributes. Rows and row bytes
// come from the buffer itself, so they cannot disagree with what is mapped. A source whose geometry
// would reach past its row (never produced by the Python checks) is treated as having no rows, so no
// byte outside a buffer is ever read (make_source_view in canary_core.h).
inline RealKvSources real_kv_sources(const ffi::RemainingArgs& srcs, int32_t mode,
                                     ffi::Span<const int64_t> page_size,
                                     ffi::Span<const int64_t> bytes_per_token,
                                     ffi::Span<const int64_t> read_bytes,
                                     ffi::Span<const int64_t> offset_bytes) {
  RealKvSources out{};
  out.mode = mode;
  out.count = 0;
  const size_t n = srcs.size() < static_cast<size_t>(MAX_REAL_KV_SOURCES) ? srcs.size() : MAX_REAL_KV_SOURCES;
  for (size_t k = 0; k < n; ++k) {
    auto buf = srcs.get<ffi::AnyBuffer>(k);
    if (!buf.has_value() || k >= page_size.size() || k >= bytes_per_token.size() || k >= read_bytes.size() ||
        k >= offset_bytes.size())
      break;
    const int64_t rows = dim_or_zero(*buf, 0);
    const int64_t row_bytes = rows > 0 ? static_cast<int64_t>(buf->size_bytes()) / rows : 0;
    out.src[out.count++] = make_source_view(static_cast<const uint8_t*>(buf->untyped_data()), rows, row_bytes,
                                            page_size[k], bytes_per_token[k], read_bytes[k], offset_bytes[k], mode);
  }
  if (out.count == 0) out.mode = static_cast<int32_t>(RealKvHashMode::NONE);
  if (out.mode == static_cast<int32_t>(RealKvHashMode::NONE)) out.count = 0;
  return out;
}

// Results are aliased to their inputs (input_output_aliases); copy only if XLA ever hands distinct
// buffers.
template <class P, class In, class Out>
ffi::Error alias_in(typename P::Ctx ctx, const In& in, Out& out) {
  if (out->untyped_data() == in.untyped_data() || in.size_bytes() != out->size_bytes() || in.size_bytes() == 0)
    return ffi::Error::Success();
  return P::copy(ctx, out->untyped_data(), in.untyped_data(), in.size_bytes());
}

template <class P>
ffi::Error alias_log(typename P::Ctx ctx, const U8Array& ring, const I32Scalar& write_index,
                     const U8Array& kernel_counters, const U8Array& slot_counters, U8ArrayOut& ring_out,
                     I32ScalarOut& write_index_out, U8ArrayOut& kernel_counters_out, U8ArrayOut& slot_counters_out) {
  for (ffi::Error e : {alias_in<P>(ctx, ring, ring_out), alias_in<P>(ctx, write_index, write_index_out),
                       alias_in<P>(ctx, kernel_counters, kernel_counters_out),
                       alias_in<P>(ctx, slot_counters, slot_counters_out)})
    if (e.failure()) return e;
  return ffi::Error::Success();
}

// ---- binding pieces shared by verify and write ---------------------------------------------------
// The log's four buffers (ring, write_index, kernel_run_counters, slot_run_counters), as arguments or
// as the results aliased to them.
template <class B>
auto log_args(B&& b) {
  return std::move(b).template Arg<U8Array>().template Arg<I32Scalar>().template Arg<U8Array>().template Arg<U8Array>();
}
template <class B>
auto log_results(B&& b) {
  return std::move(b).template Ret<U8Array>().template Ret<I32Scalar>().template Ret<U8Array>().template Ret<U8Array>();
}
// The real-KV attributes: mode:i32 and the per-source geometry
// page_size/bytes_per_token/read_bytes/offset_bytes: i64[4].
template <class B>
auto source_attrs(B&& b) {
  return std::move(b).template Attr<int32_t>("mode")
      .template Attr<ffi::Span<const int64_t>>("page_size")
      .template Attr<ffi::Span<const int64_t>>("bytes_per_token")
      .template Attr<ffi::Span<const int64_t>>("read_bytes")
      .template Attr<ffi::Span<const int64_t>>("offset_bytes");
}

// ---- VERIFY --------------------------------------------------------------------------------------
// kvcanary_verify(canary, ring, write_index, kernel_counters, slot_counters,
//                 slot_indices, expected_tokens, expected_positions, prev_slot_indices, num_valid, enable,
//                 *sources) -> (ring, write_index, kernel_counters, slot_counters, scratch)
//   attrs: tag:i64, check_token:bool, mode:i32, page_size/bytes_per_token/read_bytes/offset_bytes: i64[4]
template <class P>
auto verify_binding() {
  auto args = log_args(ffi::Ffi::Bind().template Ctx<typename P::Context>().template Arg<U8Array>())  // canary
                  .template Arg<ffi::AnyBuffer>()      // slot_indices
                  .template Arg<ffi::AnyBuffer>()      // expected_tokens
                  .template Arg<ffi::AnyBuffer>()      // expected_positions
                  .template Arg<ffi::AnyBuffer>()      // prev_slot_indices
                  .template Arg<I32Scalar>()  // num_valid
                  .template Arg<I32Scalar>()  // enable
                  .RemainingArgs();           // real-KV sources
  return source_attrs(log_results(std::move(args))
                          .template Ret<ffi::Buffer<ffi::U8, 1>>()  // scratch
                          .template Attr<int64_t>("tag")
                          .template Attr<bool>("check_token"));
}

template <class P>
ffi::Error verify_handler(typename P::Ctx ctx, U8Array canary, U8Array ring, I32Scalar write_index,
                          U8Array kernel_counters, U8Array slot_counters, ffi::AnyBuffer slots,
                          ffi::AnyBuffer tokens, ffi::AnyBuffer positions, ffi::AnyBuffer prevs,
                          I32Scalar num_valid, I32Scalar enable, ffi::RemainingArgs srcs, U8ArrayOut ring_out,
                          I32ScalarOut write_index_out, U8ArrayOut kernel_counters_out,
                          U8ArrayOut slot_counters_out, ScratchOut scratch, int64_t tag, bool check_token,
                          int32_t mode, ffi::Span<const int64_t> page_size,
                          ffi::Span<const int64_t> bytes_per_token, ffi::Span<const int64_t> read_bytes,
                          ffi::Span<const int64_t> offset_bytes) {
  ffi::Error err = alias_log<P>(ctx, ring, write_index, kernel_counters, slot_counters, ring_out,
                                write_index_out, kernel_counters_out, slot_counters_out);
  if (err.failure()) return err;
  VerifyArgs a{};
  a.canary = canary_view(canary);
  a.slots = index_view(slots);
  a.tokens = index_view(tokens);
  a.positions = index_view(positions);
  a.prevs = index_view(prevs);
  a.check_token = check_token;
  a.sources = real_kv_sources(srcs, mode, page_size, bytes_per_token, read_bytes, offset_bytes);
  a.tag = tag;
  return P::verify(ctx, a, dim_or_zero(slots, 0), num_valid.typed_data(), enable.typed_data(),
                   log_view(ring_out, write_index_out, kernel_counters_out, slot_counters_out),
                   scratch_view(scratch));
}

// ---- WRITE ---------------------------------------------------------------------------------------
// kvcanary_write(canary, ring, write_index, kernel_counters, slot_counters, chain_assert_flag,
//                offsets, seed_slot_indices, num_valid_reqs, input_ids, positions, out_cache_loc,
//                expected_tokens, expected_positions, *sources)
//   -> (canary, ring, write_index, kernel_counters, slot_counters, scratch)
//   attrs: tag:i64, input_assert:bool, mode:i32, page_size/bytes_per_token/read_bytes/offset_bytes: i64[4]
template <class P>
auto write_binding() {
  auto args = log_args(ffi::Ffi::Bind().template Ctx<typename P::Context>().template Arg<U8Array>())  // canary
                  .template Arg<I32Scalar>()  // enable_chain_position_assert
                  .template Arg<ffi::AnyBuffer>()      // offsets
                  .template Arg<ffi::AnyBuffer>()      // seed_slot_indices
                  .template Arg<I32Scalar>()  // num_valid_reqs
                  .template Arg<ffi::AnyBuffer>()      // input_ids
                  .template Arg<ffi::AnyBuffer>()      // positions
                  .template Arg<ffi::AnyBuffer>()      // out_cache_loc
                  .template Arg<ffi::AnyBuffer>()      // expected_input_tokens (length 0 when the assert is off)
                  .template Arg<ffi::AnyBuffer>()      // expected_input_positions (likewise)
                  .RemainingArgs();           // real-KV sources
  return source_attrs(log_results(std::move(args).template Ret<U8Array>())      // canary
                          .template Ret<ffi::Buffer<ffi::U8, 1>>()  // scratch
                          .template Attr<int64_t>("tag")
                          .template Attr<bool>("input_assert"));
}

template <class P>
ffi::Error write_handler(typename P::Ctx ctx, U8Array canary, U8Array ring, I32Scalar write_index,
                         U8Array kernel_counters, U8Array slot_counters, I32Scalar chain_flag,
                         ffi::AnyBuffer offsets, ffi::AnyBuffer seeds, I32Scalar num_valid_reqs,
                         ffi::AnyBuffer input_ids, ffi::AnyBuffer positions, ffi::AnyBuffer locs,
                         ffi::AnyBuffer exp_tokens, ffi::AnyBuffer exp_positions, ffi::RemainingArgs srcs,
                         U8ArrayOut canary_out, U8ArrayOut ring_out, I32ScalarOut write_index_out,
                         U8ArrayOut kernel_counters_out, U8ArrayOut slot_counters_out, ScratchOut scratch,
                         int64_t tag, bool input_assert, int32_t mode, ffi::Span<const int64_t> page_size,
                         ffi::Span<const int64_t> bytes_per_token, ffi::Span<const int64_t> read_bytes,
                         ffi::Span<const int64_t> offset_bytes) {
  ffi::Error err = alias_in<P>(ctx, canary, canary_out);
  if (err.success())
    err = alias_log<P>(ctx, ring, write_index, kernel_counters, slot_counters, ring_out, write_index_out,
                       kernel_counters_out, slot_counters_out);
  if (err.failure()) return err;
  const int64_t n_tokens = dim_or_zero(input_ids, 0);
  WriteArgs a{};
  a.canary = canary_view(*canary_out);
  a.seeds = index_view(seeds);
  a.input_ids = index_view(input_ids);
  a.positions = index_view(positions);
  a.locs = index_view(locs);
  a.exp_tokens = index_view(exp_tokens);
  a.exp_positions = index_view(exp_positions);
  // Honoured only when both expected arrays are as long as the inputs (Python passes empty ones
  // when the assert is off), so the assert can never read past them.
  a.input_assert = input_assert && dim_or_zero(exp_tokens, 0) >= n_tokens && dim_or_zero(exp_positions, 0) >= n_tokens;
  a.chain_assert = false;  // a buffer value: the launcher reads chain_flag
  a.sources = real_kv_sources(srcs, mode, page_size, bytes_per_token, read_bytes, offset_bytes);
  a.tag = tag;
  return P::write(ctx, a, index_view(offsets), dim_or_zero(seeds, 0), n_tokens, num_valid_reqs.typed_data(),
                  chain_flag.typed_data(),
                  log_view(ring_out, write_index_out, kernel_counters_out, slot_counters_out),
                  scratch_view(scratch));
}

// ---- PLAN ----------------------------------------------------------------------------------------
// kvcanary_plan(req_pool_indices, prefix_lens, extend_seq_lens, req_to_token, lut, pool, valid_lens,
//               row_starts)
//   -> (slot_indices, expected_tokens, expected_positions, prev_slot_indices, num_valid, enable,
//       offsets, seed_slot_indices, num_valid_reqs, scratch)   all int32 but scratch
//   attrs: window:i64, token_offset:i64, has_lut:bool, has_pool:bool, has_row_starts:bool
template <class P>
auto plan_binding() {
  return ffi::Ffi::Bind()
      .template Ctx<typename P::Context>()
      .template Arg<ffi::AnyBuffer>()  // req_pool_indices
      .template Arg<ffi::AnyBuffer>()  // prefix_lens
      .template Arg<ffi::AnyBuffer>()  // extend_seq_lens
      .template Arg<ffi::AnyBuffer>()  // req_to_token
      .template Arg<ffi::AnyBuffer>()  // full_to_swa_index_mapping (length 0 without one)
      .template Arg<ffi::AnyBuffer>()  // req_to_verify_expected_tokens (0 x 0 without one)
      .template Arg<ffi::AnyBuffer>()  // req_to_verify_expected_tokens_valid_lens
      .template Arg<ffi::AnyBuffer>()  // row_starts (length 0 without them)
      .template Ret<ffi::Buffer<ffi::S32, 1>>()
      .template Ret<ffi::Buffer<ffi::S32, 1>>()
      .template Ret<ffi::Buffer<ffi::S32, 1>>()
      .template Ret<ffi::Buffer<ffi::S32, 1>>()
      .template Ret<I32Scalar>()
      .template Ret<I32Scalar>()
      .template Ret<ffi::Buffer<ffi::S32, 1>>()
      .template Ret<ffi::Buffer<ffi::S32, 1>>()
      .template Ret<I32Scalar>()
      .template Ret<ffi::Buffer<ffi::U8, 1>>()  // scratch
      .template Attr<int64_t>("window")
      .template Attr<int64_t>("token_offset")
      .template Attr<bool>("has_lut")
      .template Attr<bool>("has_pool")
      .template Attr<bool>("has_row_starts");
}

template <class P>
ffi::Error plan_handler(typename P::Ctx ctx, ffi::AnyBuffer rpi, ffi::AnyBuffer prefix, ffi::AnyBuffer extend,
                        ffi::AnyBuffer r2t, ffi::AnyBuffer lut, ffi::AnyBuffer pool, ffi::AnyBuffer valid_lens,
                        ffi::AnyBuffer row_starts, I32VectorOut slots, I32VectorOut tokens, I32VectorOut positions, I32VectorOut prevs,
                        I32ScalarOut num_valid, I32ScalarOut enable, I32VectorOut offsets, I32VectorOut seeds,
                        I32ScalarOut num_valid_reqs, ScratchOut scratch, int64_t window, int64_t token_offset,
                        bool has_lut, bool has_pool, bool has_row_starts) {
  const int64_t vcap = static_cast<int64_t>(slots->element_count());
  const int64_t wcap = static_cast<int64_t>(seeds->element_count());
  const int64_t bs = dim_or_zero(rpi, 0) < wcap ? dim_or_zero(rpi, 0) : wcap;  // never index past the outputs
  const size_t r2t_rank = r2t.dimensions().size();
  PlanArgs a{};
  a.req_pool_indices = index_view(rpi);
  a.prefix_lens = index_view(prefix);
  a.extend_seq_lens = index_view(extend);
  a.req_to_token = index_view(r2t);
  // The flat table is honoured only with a 1-D table and a start for every planned row; the 2-D
  // shape only from a 2-D table. Anything else (never produced by the Python checks) reads nothing.
  a.has_row_starts = has_row_starts && r2t_rank == 1 && dim_or_zero(row_starts, 0) >= bs;
  a.row_starts = index_view(row_starts);
  a.N = a.has_row_starts ? dim_or_zero(r2t, 0) : 0;
  a.R = r2t_rank == 2 ? dim_or_zero(r2t, 0) : 0;
  a.L = r2t_rank == 2 ? dim_or_zero(r2t, 1) : 0;
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
  const PlanOut out{slots->typed_data(),    tokens->typed_data(),    positions->typed_data(),
                    prevs->typed_data(),    num_valid->typed_data(), enable->typed_data(),
                    offsets->typed_data(),  seeds->typed_data(),     num_valid_reqs->typed_data()};
  return P::plan(ctx, a, bs, vcap, wcap, out, scratch_view(scratch));
}

// ---- scatter_req_token_ids -----------------------------------------------------------------------
// kvcanary_scatter(pool, flat_ids, offsets, req_pool_indices) -> (pool)
template <class P>
auto scatter_binding() {
  return ffi::Ffi::Bind()
      .template Ctx<typename P::Context>()
      .template Arg<ffi::AnyBuffer>()  // pool, int32 or int64 [Rp, Cp]
      .template Arg<ffi::AnyBuffer>()  // flat_ids
      .template Arg<ffi::AnyBuffer>()  // offsets
      .template Arg<ffi::AnyBuffer>()  // req_pool_indices
      .template Ret<ffi::AnyBuffer>();
}

template <class P>
ffi::Error scatter_handler(typename P::Ctx ctx, ffi::AnyBuffer pool, ffi::AnyBuffer flat_ids,
                           ffi::AnyBuffer offsets, ffi::AnyBuffer rpi, ffi::Result<ffi::AnyBuffer> pool_out) {
  const ffi::Error err = alias_in<P>(ctx, pool, pool_out);
  if (err.failure()) return err;
  const int64_t rows = dim_or_zero(pool, 0), cols = dim_or_zero(pool, 1);
  const int64_t bs = dim_or_zero(rpi, 0), total = dim_or_zero(flat_ids, 0);
  if (pool.element_type() == ffi::DataType::S64)
    return P::scatter(ctx, static_cast<int64_t*>(pool_out->untyped_data()), rows, cols, index_view(flat_ids), total,
                      index_view(offsets), index_view(rpi), bs);
  return P::scatter(ctx, static_cast<int32_t*>(pool_out->untyped_data()), rows, cols, index_view(flat_ids), total,
                    index_view(offsets), index_view(rpi), bs);
}

}  // namespace kvcanary
