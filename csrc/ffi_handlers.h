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
// The Python wrappers check every argument at trace time; the targets are registered for the whole
// process, though, so exported HLO or a direct jax.ffi.ffi_call reaches a handler without them. Each
// handler therefore first runs its op's check function (check_verify, check_write, check_plan,
// check_scatter), which returns InvalidArgument with a "kv-canary: <target>: ..." message naming the
// argument, the expected and the actual value, before any buffer is touched. Data (slot indices,
// lengths inside the arrays) never fails: it is bounded by the core (docs/format.md).
#pragma once

#include <cstdint>
#include <string>
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

// Bytes per row of a real-KV source buffer (its leading dimension is the row); 0 without rows.
inline int64_t row_bytes_of(const ffi::AnyBuffer& b) {
  const int64_t rows = dim_or_zero(b, 0);
  return rows > 0 ? static_cast<int64_t>(b.size_bytes()) / rows : 0;
}

// Real-KV sources: buffers from RemainingArgs, geometry from static attributes, as check_sources
// accepted them (the handlers run it first). Rows and row bytes come from the buffer itself, so they
// cannot disagree with what is mapped; the core still treats a geometry that would reach past a row
// as a source without rows (make_source_view in canary_core.h).
inline RealKvSources real_kv_sources(const ffi::RemainingArgs& srcs, int32_t mode,
                                     ffi::Span<const int64_t> page_size,
                                     ffi::Span<const int64_t> bytes_per_token,
                                     ffi::Span<const int64_t> read_bytes,
                                     ffi::Span<const int64_t> offset_bytes) {
  RealKvSources out{};
  out.mode = static_cast<int32_t>(RealKvHashMode::NONE);
  out.count = 0;
  if (mode == static_cast<int32_t>(RealKvHashMode::NONE) || srcs.size() == 0) return out;
  out.mode = mode;
  for (size_t k = 0; k < srcs.size(); ++k) {
    const ffi::AnyBuffer buf = *srcs.get<ffi::AnyBuffer>(k);
    out.src[out.count++] =
        make_source_view(static_cast<const uint8_t*>(buf.untyped_data()), dim_or_zero(buf, 0), row_bytes_of(buf),
                         page_size[k], bytes_per_token[k], read_bytes[k], offset_bytes[k], mode);
  }
  return out;
}

// ---- argument checks --------------------------------------------------------------------------------
inline std::string num(int64_t v) { return std::to_string(v); }

inline ffi::Error invalid(const char* op, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string("kv-canary: ") + op + ": " + what);
}

// An index buffer: int32 or int64, of rank `rank`.
inline ffi::Error check_index_rank(const char* op, const char* name, const ffi::AnyBuffer& b, size_t rank) {
  const ffi::DataType t = b.element_type();
  if (t != ffi::DataType::S32 && t != ffi::DataType::S64)
    return invalid(op, std::string(name) + " must have dtype int32 or int64, got type code " +
                           num(static_cast<int64_t>(t)));
  if (b.dimensions().size() != rank)
    return invalid(op, std::string(name) + " must be " + num(rank) + "-D, got rank " + num(b.dimensions().size()));
  return ffi::Error::Success();
}

// An index array: int32 or int64, 1-D, `len` long (any length when len < 0).
inline ffi::Error check_index(const char* op, const char* name, const ffi::AnyBuffer& b, int64_t len) {
  if (ffi::Error e = check_index_rank(op, name, b, 1); e.failure()) return e;
  if (len >= 0 && b.dimensions()[0] != len)
    return invalid(op, std::string(name) + " length must be " + num(len) + ", got " + num(b.dimensions()[0]));
  return ffi::Error::Success();
}

// An index matrix: int32 or int64, 2-D.
inline ffi::Error check_index_matrix(const char* op, const char* name, const ffi::AnyBuffer& b) {
  return check_index_rank(op, name, b, 2);
}

template <ffi::DataType T, size_t R>
ffi::Error check_count(const char* op, const char* name, const ffi::Buffer<T, R>& b, int64_t n) {
  if (static_cast<int64_t>(b.element_count()) != n)
    return invalid(op, std::string(name) + " must hold " + num(n) + " element(s), got " + num(b.element_count()));
  return ffi::Error::Success();
}

// The canary, the log's four buffers and the launch tag (verify, write).
inline ffi::Error check_log(const char* op, const U8Array& canary, const U8Array& ring, const I32Scalar& write_index,
                            const U8Array& kernel_counters, const U8Array& slot_counters, int64_t tag) {
  const int64_t slots = dim_or_zero(canary, 0), stride = dim_or_zero(canary, 1);
  if (slots < 1) return invalid(op, "canary must have at least 1 slot, got " + num(slots));
  if (stride < CANARY_SLOT_BYTES || stride % 8)
    return invalid(op, "canary slot stride must be a multiple of 8 bytes and at least 32, got " + num(stride));
  if (dim_or_zero(ring, 0) < 1 || dim_or_zero(ring, 1) != VIOLATION_ROW_BYTES)
    return invalid(op, "log.ring must be [capacity >= 1, 64] bytes, got [" + num(dim_or_zero(ring, 0)) + ", " +
                           num(dim_or_zero(ring, 1)) + "]");
  if (ffi::Error e = check_count(op, "log.write_index", write_index, 1); e.failure()) return e;
  const int64_t tags = dim_or_zero(kernel_counters, 0);
  if (tags < 1 || dim_or_zero(kernel_counters, 1) != COUNTER_BYTES || dim_or_zero(slot_counters, 0) != tags ||
      dim_or_zero(slot_counters, 1) != COUNTER_BYTES)
    return invalid(op, "log counters must both be [num_tags >= 1, 8] bytes, got [" + num(tags) + ", " +
                           num(dim_or_zero(kernel_counters, 1)) + "] and [" + num(dim_or_zero(slot_counters, 0)) +
                           ", " + num(dim_or_zero(slot_counters, 1)) + "]");
  if (tag < 0 || tag >= tags) return invalid(op, "tag must be in [0, " + num(tags) + "), got " + num(tag));
  return ffi::Error::Success();
}

// The real-KV mode, sources and their geometry attributes (format.md §4.4): a source whose strip
// would reach past its row is refused rather than read (a source without rows is never read: every
// slot of it is out of range).
inline ffi::Error check_sources(const char* op, const ffi::RemainingArgs& srcs, int32_t mode,
                                ffi::Span<const int64_t> page_size, ffi::Span<const int64_t> bytes_per_token,
                                ffi::Span<const int64_t> read_bytes, ffi::Span<const int64_t> offset_bytes) {
  if (mode < 0 || mode > 2) return invalid(op, "mode must be 0 (NONE), 1 (PARTIAL) or 2 (ALL), got " + num(mode));
  const int64_t n = static_cast<int64_t>(srcs.size());
  if (n > MAX_REAL_KV_SOURCES) return invalid(op, "at most 4 real-KV sources, got " + num(n));
  if (mode == static_cast<int32_t>(RealKvHashMode::NONE)) return ffi::Error::Success();
  for (int64_t k = 0; k < n; ++k) {
    auto buf = srcs.get<ffi::AnyBuffer>(k);
    if (!buf.has_value()) return invalid(op, "real-KV source " + num(k) + " is not a buffer");
    if (k >= static_cast<int64_t>(page_size.size()) || k >= static_cast<int64_t>(bytes_per_token.size()) ||
        k >= static_cast<int64_t>(read_bytes.size()) || k >= static_cast<int64_t>(offset_bytes.size()))
      return invalid(op, "the geometry attributes must have an entry for each of the " + num(n) + " sources");
    const int64_t rows = dim_or_zero(*buf, 0), row_bytes = row_bytes_of(*buf);
    const int64_t ps = page_size[k], bpt = bytes_per_token[k], off = offset_bytes[k];
    const int64_t eff = mode == static_cast<int32_t>(RealKvHashMode::PARTIAL) ? REAL_KV_PARTIAL_BYTES : read_bytes[k];
    if (ps < 1 || bpt <= 0 || bpt % REAL_KV_CHUNK_BYTES || eff <= 0 || eff % REAL_KV_CHUNK_BYTES || eff > bpt ||
        off < 0 || off % REAL_KV_CHUNK_BYTES || off > bpt - eff || (rows > 0 && ps > row_bytes / bpt))
      return invalid(op, "real-KV source " + num(k) + " geometry (page_size " + num(ps) + ", bytes_per_token " +
                             num(bpt) + ", read " + num(eff) + " bytes at offset " + num(off) +
                             ") does not fit its rows of " + num(row_bytes) + " bytes");
  }
  return ffi::Error::Success();
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

inline ffi::Error check_verify(const U8Array& canary, const U8Array& ring, const I32Scalar& write_index,
                               const U8Array& kernel_counters, const U8Array& slot_counters,
                               const ffi::AnyBuffer& slots, const ffi::AnyBuffer& tokens,
                               const ffi::AnyBuffer& positions, const ffi::AnyBuffer& prevs,
                               const I32Scalar& num_valid, const I32Scalar& enable, const ffi::RemainingArgs& srcs,
                               int64_t tag, int32_t mode, ffi::Span<const int64_t> page_size,
                               ffi::Span<const int64_t> bytes_per_token, ffi::Span<const int64_t> read_bytes,
                               ffi::Span<const int64_t> offset_bytes) {
  constexpr const char* op = "kvcanary_verify";
  const int64_t cap = dim_or_zero(slots, 0);
  for (ffi::Error e : {check_log(op, canary, ring, write_index, kernel_counters, slot_counters, tag),
                       check_index(op, "slot_indices", slots, -1),
                       cap < 1 ? invalid(op, "verify capacity must be positive, got 0") : ffi::Error::Success(),
                       check_index(op, "expected_tokens", tokens, cap),
                       check_index(op, "expected_positions", positions, cap),
                       check_index(op, "prev_slot_indices", prevs, cap), check_count(op, "num_valid", num_valid, 1),
                       check_count(op, "enable", enable, 1),
                       check_sources(op, srcs, mode, page_size, bytes_per_token, read_bytes, offset_bytes)})
    if (e.failure()) return e;
  return ffi::Error::Success();
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
  ffi::Error err = check_verify(canary, ring, write_index, kernel_counters, slot_counters, slots, tokens, positions,
                                prevs, num_valid, enable, srcs, tag, mode, page_size, bytes_per_token, read_bytes,
                                offset_bytes);
  if (err.success())
    err = alias_log<P>(ctx, ring, write_index, kernel_counters, slot_counters, ring_out, write_index_out,
                       kernel_counters_out, slot_counters_out);
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

inline ffi::Error check_write(const U8Array& canary, const U8Array& ring, const I32Scalar& write_index,
                              const U8Array& kernel_counters, const U8Array& slot_counters, const I32Scalar& chain_flag,
                              const ffi::AnyBuffer& offsets, const ffi::AnyBuffer& seeds,
                              const I32Scalar& num_valid_reqs, const ffi::AnyBuffer& input_ids,
                              const ffi::AnyBuffer& positions, const ffi::AnyBuffer& locs,
                              const ffi::AnyBuffer& exp_tokens, const ffi::AnyBuffer& exp_positions,
                              const ffi::RemainingArgs& srcs, int64_t tag, bool input_assert, int32_t mode,
                              ffi::Span<const int64_t> page_size, ffi::Span<const int64_t> bytes_per_token,
                              ffi::Span<const int64_t> read_bytes, ffi::Span<const int64_t> offset_bytes) {
  constexpr const char* op = "kvcanary_write";
  const int64_t reqs = dim_or_zero(seeds, 0), n = dim_or_zero(input_ids, 0);
  // the expected arrays are read only with the input assert (Python passes empty ones without it)
  const int64_t expected_len = input_assert ? n : -1;
  for (ffi::Error e : {check_log(op, canary, ring, write_index, kernel_counters, slot_counters, tag),
                       check_count(op, "enable_chain_position_assert", chain_flag, 1),
                       check_index(op, "seed_slot_indices", seeds, -1),
                       check_index(op, "offsets", offsets, reqs + 1),
                       check_count(op, "num_valid_reqs", num_valid_reqs, 1),
                       check_index(op, "input_ids", input_ids, -1), check_index(op, "positions", positions, n),
                       check_index(op, "out_cache_loc", locs, n),
                       check_index(op, "expected_input_tokens", exp_tokens, expected_len),
                       check_index(op, "expected_input_positions", exp_positions, expected_len),
                       check_sources(op, srcs, mode, page_size, bytes_per_token, read_bytes, offset_bytes)})
    if (e.failure()) return e;
  return ffi::Error::Success();
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
  ffi::Error err = check_write(canary, ring, write_index, kernel_counters, slot_counters, chain_flag, offsets, seeds,
                               num_valid_reqs, input_ids, positions, locs, exp_tokens, exp_positions, srcs, tag,
                               input_assert, mode, page_size, bytes_per_token, read_bytes, offset_bytes);
  if (err.success()) err = alias_in<P>(ctx, canary, canary_out);
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
  a.input_assert = input_assert;
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

// The element counts of plan's results (XLA allocates them from the call's result shapes).
struct PlanResultSizes {
  int64_t slots, tokens, positions, prevs, offsets, seeds;
  bool scalars;  // num_valid, enable and num_valid_reqs hold one element each
};

inline ffi::Error check_plan(const ffi::AnyBuffer& rpi, const ffi::AnyBuffer& prefix, const ffi::AnyBuffer& extend,
                             const ffi::AnyBuffer& r2t, const ffi::AnyBuffer& lut, const ffi::AnyBuffer& pool,
                             const ffi::AnyBuffer& valid_lens, const ffi::AnyBuffer& row_starts,
                             const PlanResultSizes& out, int64_t window, int64_t token_offset, bool has_lut,
                             bool has_pool, bool has_row_starts) {
  constexpr const char* op = "kvcanary_plan";
  const int64_t bs = dim_or_zero(rpi, 0);
  const int64_t vcap = out.slots, wcap = out.seeds;
  const auto ok = ffi::Error::Success();
  for (ffi::Error e :
       {check_index(op, "req_pool_indices", rpi, -1), check_index(op, "prefix_lens", prefix, bs),
        check_index(op, "extend_seq_lens", extend, bs),
        has_row_starts ? check_index(op, "req_to_token (a flat table with row_starts)", r2t, -1)
                       : check_index_matrix(op, "req_to_token", r2t),
        has_row_starts ? check_index(op, "row_starts", row_starts, bs) : ok,
        has_lut ? check_index(op, "full_to_swa_index_mapping", lut, -1) : ok,
        has_lut && dim_or_zero(lut, 0) < 1 ? invalid(op, "full_to_swa_index_mapping length must be >= 1, got 0") : ok,
        !has_lut && window > 0 ? invalid(op, "a window > 0 needs full_to_swa_index_mapping (has_lut)") : ok,
        window < 0 ? invalid(op, "window must be >= 0, got " + num(window)) : ok,
        token_offset < INT32_MIN || token_offset > INT32_MAX
            ? invalid(op, "token_offset must fit in int32, got " + num(token_offset))
            : ok,
        has_pool ? check_index_matrix(op, "req_to_verify_expected_tokens", pool) : ok,
        has_pool ? check_index(op, "req_to_verify_expected_tokens_valid_lens", valid_lens, bs) : ok,
        vcap < 1 ? invalid(op, "the verify entry results must hold >= 1 entry, got 0") : ok,
        out.tokens != vcap || out.positions != vcap || out.prevs != vcap
            ? invalid(op, "the four verify entry results must have the same length " + num(vcap))
            : ok,
        bs > wcap ? invalid(op, "bs=" + num(bs) + " exceeds the write request results' " + num(wcap)) : ok,
        out.offsets != wcap + 1
            ? invalid(op, "the offsets result must hold " + num(wcap + 1) + " entries, got " + num(out.offsets))
            : ok,
        !out.scalars ? invalid(op, "num_valid, enable and num_valid_reqs results must hold 1 element each") : ok})
    if (e.failure()) return e;
  return ok;
}

template <class P>
ffi::Error plan_handler(typename P::Ctx ctx, ffi::AnyBuffer rpi, ffi::AnyBuffer prefix, ffi::AnyBuffer extend,
                        ffi::AnyBuffer r2t, ffi::AnyBuffer lut, ffi::AnyBuffer pool, ffi::AnyBuffer valid_lens,
                        ffi::AnyBuffer row_starts, I32VectorOut slots, I32VectorOut tokens, I32VectorOut positions, I32VectorOut prevs,
                        I32ScalarOut num_valid, I32ScalarOut enable, I32VectorOut offsets, I32VectorOut seeds,
                        I32ScalarOut num_valid_reqs, ScratchOut scratch, int64_t window, int64_t token_offset,
                        bool has_lut, bool has_pool, bool has_row_starts) {
  const PlanResultSizes sizes{
      static_cast<int64_t>(slots->element_count()),   static_cast<int64_t>(tokens->element_count()),
      static_cast<int64_t>(positions->element_count()), static_cast<int64_t>(prevs->element_count()),
      static_cast<int64_t>(offsets->element_count()), static_cast<int64_t>(seeds->element_count()),
      num_valid->element_count() == 1 && enable->element_count() == 1 && num_valid_reqs->element_count() == 1};
  const ffi::Error err = check_plan(rpi, prefix, extend, r2t, lut, pool, valid_lens, row_starts, sizes, window,
                                    token_offset, has_lut, has_pool, has_row_starts);
  if (err.failure()) return err;
  const int64_t vcap = static_cast<int64_t>(slots->element_count());
  const int64_t wcap = static_cast<int64_t>(seeds->element_count());
  const int64_t bs = dim_or_zero(rpi, 0);
  const size_t r2t_rank = r2t.dimensions().size();
  PlanArgs a{};
  a.req_pool_indices = index_view(rpi);
  a.prefix_lens = index_view(prefix);
  a.extend_seq_lens = index_view(extend);
  a.req_to_token = index_view(r2t);
  a.has_row_starts = has_row_starts;
  a.row_starts = index_view(row_starts);
  a.N = a.has_row_starts ? dim_or_zero(r2t, 0) : 0;
  a.R = r2t_rank == 2 ? dim_or_zero(r2t, 0) : 0;
  a.L = r2t_rank == 2 ? dim_or_zero(r2t, 1) : 0;
  a.has_lut = has_lut;
  a.lut = index_view(lut);
  a.lut_len = dim_or_zero(lut, 0);
  a.has_pool = has_pool;
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
  constexpr const char* op = "kvcanary_scatter";
  for (ffi::Error e : {check_index_matrix(op, "pool", pool), check_index(op, "flat_ids", flat_ids, -1),
                       check_index(op, "req_pool_indices", rpi, -1),
                       check_index(op, "offsets", offsets, dim_or_zero(rpi, 0) + 1),
                       pool_out->element_type() != pool.element_type() || pool_out->size_bytes() != pool.size_bytes()
                           ? invalid(op, "the result must have the pool's dtype and shape")
                           : ffi::Error::Success()})
    if (e.failure()) return e;
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
