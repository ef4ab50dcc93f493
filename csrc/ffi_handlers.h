// ffi_handlers.h: the XLA FFI handler of each op, written once for both platforms.
//
// A handler binds the op's buffers and attributes (one signature per op, the contract with
// src/jax_kvcanary/_ffi.py), describes them as the op's call (call_args.h), runs the op's check,
// makes the aliased results hold their inputs and calls its platform's launcher with the call's
// launch arguments. cpu_handlers.cc and cuda/cuda_handlers.cc instantiate the handlers with a
// Platform that supplies only what differs:
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
// scalars (num_valid, enable, ...) are passed as pointers for that reason. The CUDA lowering appends
// one more result to verify, write and plan: the uint8 scratch of its kernels (cuda/cuda_kernels.h),
// bound as the remaining results; the CPU lowering has none (ScratchView{nullptr, 0}).
//
// Buffers whose dtype is fixed by the format (canary, log, plan scalars and outputs) are typed; index
// arrays are int32 or int64 (AnyBuffer, widened on read) and real-KV sources any dtype. Each op's
// attributes decode as one struct (VerifyAttrs, WriteAttrs, PlanAttrs: ffi_attrs.h).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include "call_args.h"
#include "canary_core.h"
#include "ffi_attrs.h"
#include "xla/ffi/api/ffi.h"

namespace kvcanary {
namespace ffi = ::xla::ffi;

using U8Array = ffi::Buffer<ffi::U8, 2>;   // canary [num_slots, stride], ring [cap, 64], counters [T, 8]
using I32Scalar = ffi::Buffer<ffi::S32, 1>;  // int32[1]
using U8ArrayOut = ffi::Result<U8Array>;
using I32ScalarOut = ffi::Result<I32Scalar>;
using I32VectorOut = ffi::Result<ffi::Buffer<ffi::S32, 1>>;

// ---- XLA's buffers and attributes -> the call (call_args.h) ------------------------------------------
inline ElemType elem_type(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::U8: return ElemType::U8;
    case ffi::DataType::S32: return ElemType::S32;
    case ffi::DataType::S64: return ElemType::S64;
    default: return ElemType::OTHER;
  }
}

template <class B>  // ffi::AnyBuffer or ffi::Buffer<T, R>
Array array_of(const B& b) {
  const auto dims = b.dimensions();
  const int64_t rank = static_cast<int64_t>(dims.size());
  int64_t elements = 1;
  for (int64_t d : dims) elements *= d;
  return Array{b.untyped_data(),
               elem_type(b.element_type()),
               rank,
               rank > 0 ? dims[0] : 0,
               rank > 1 ? dims[1] : 0,
               elements,
               elements * static_cast<int64_t>(ffi::ByteWidth(b.element_type()))};
}

inline bool same_shape(const Array& a, const Array& b) {
  return a.type == b.type && a.rank == b.rank && a.dim0 == b.dim0 && a.dim1 == b.dim1 && a.bytes == b.bytes;
}

// The log of a verify or write call: its result buffers (where the launcher reads and writes), and
// whether each has the shape of the input it aliases (`canary_in`: write's canary, aliased too).
inline LogCall log_call(const U8Array& canary, const U8Array* canary_in, const U8Array& ring,
                        const I32Scalar& write_index, const U8Array& kernel_counters,
                        const U8Array& slot_counters, U8ArrayOut& ring_out, I32ScalarOut& write_index_out,
                        U8ArrayOut& kernel_counters_out, U8ArrayOut& slot_counters_out, int64_t tag) {
  LogCall c{array_of(canary), array_of(*ring_out), array_of(*write_index_out), array_of(*kernel_counters_out),
            array_of(*slot_counters_out), tag, true};
  c.results_match_inputs = (canary_in == nullptr || same_shape(array_of(*canary_in), c.canary)) &&
                           same_shape(array_of(ring), c.ring) && same_shape(array_of(write_index), c.write_index) &&
                           same_shape(array_of(kernel_counters), c.kernel_counters) &&
                           same_shape(array_of(slot_counters), c.slot_counters);
  return c;
}

inline SourcesCall sources_call(const ffi::RemainingArgs& srcs, const RealKvAttrSpans& attrs) {
  SourcesCall c;
  c.count = static_cast<int64_t>(srcs.size());
  for (int64_t k = 0; k < c.count && k < MAX_REAL_KV_SOURCES; ++k) {
    auto buf = srcs.get<ffi::AnyBuffer>(k);
    if (buf.has_value()) c.src[k] = array_of(*buf);
    else c.all_buffers = false;
  }
  RealKvAttrs& g = c.attrs;
  g.mode = attrs.mode;
  g.entries = MAX_REAL_KV_SOURCES;
  for (auto span : {attrs.page_size, attrs.bytes_per_token, attrs.read_bytes, attrs.offset_bytes})
    if (static_cast<int64_t>(span.size()) < g.entries) g.entries = static_cast<int64_t>(span.size());
  // the geometry is read only with a mode and only for the sources given
  const int64_t used = g.mode == static_cast<int32_t>(RealKvHashMode::NONE) ? 0 : std::min(g.entries, c.count);
  for (int64_t k = 0; k < used; ++k) {
    g.page_size[k] = attrs.page_size[k];
    g.bytes_per_token[k] = attrs.bytes_per_token[k];
    g.read_bytes[k] = attrs.read_bytes[k];
    g.offset_bytes[k] = attrs.offset_bytes[k];
  }
  return c;
}

// The CUDA lowering's scratch result (the remaining results); none on the CPU.
inline ScratchView scratch_view(ffi::RemainingRets& extra) {
  if (extra.size() == 0) return ScratchView{nullptr, 0};
  auto s = extra.get<ffi::AnyBuffer>(0);
  if (!s.has_value()) return ScratchView{nullptr, 0};
  return ScratchView{(*s)->untyped_data(), (*s)->size_bytes()};
}

inline ffi::Error refused(const std::string& message) { return ffi::Error::InvalidArgument(message); }

// Results are aliased to their inputs (input_output_aliases); copy only if XLA ever hands distinct
// buffers. The checks have refused results whose shape differs from their input's.
template <class P, class In, class Out>
ffi::Error alias_in(typename P::Ctx ctx, const In& in, Out& out) {
  if (out->untyped_data() == in.untyped_data() || in.size_bytes() == 0)
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

// ---- VERIFY --------------------------------------------------------------------------------------
// kvcanary_verify(canary, ring, write_index, kernel_counters, slot_counters,
//                 slot_indices, expected_tokens, expected_positions, prev_slot_indices, num_valid, enable,
//                 *sources) -> (ring, write_index, kernel_counters, slot_counters[, scratch on CUDA])
//   attrs (VerifyAttrs): tag:i64, check_token:bool, mode:i32, page_size/bytes_per_token/read_bytes/offset_bytes: i64[4]
template <class P>
auto verify_binding() {
  auto args = log_args(ffi::Ffi::Bind().template Ctx<typename P::Context>().template Arg<U8Array>())  // canary
                  .template Arg<ffi::AnyBuffer>()  // slot_indices
                  .template Arg<ffi::AnyBuffer>()  // expected_tokens
                  .template Arg<ffi::AnyBuffer>()  // expected_positions
                  .template Arg<ffi::AnyBuffer>()  // prev_slot_indices
                  .template Arg<I32Scalar>()       // num_valid
                  .template Arg<I32Scalar>()       // enable
                  .RemainingArgs();                // real-KV sources
  return log_results(std::move(args)).RemainingRets().template Attrs<VerifyAttrs>();
}

template <class P>
ffi::Error verify_handler(typename P::Ctx ctx, U8Array canary, U8Array ring, I32Scalar write_index,
                          U8Array kernel_counters, U8Array slot_counters, ffi::AnyBuffer slots,
                          ffi::AnyBuffer tokens, ffi::AnyBuffer positions, ffi::AnyBuffer prevs,
                          I32Scalar num_valid, I32Scalar enable, ffi::RemainingArgs srcs, U8ArrayOut ring_out,
                          I32ScalarOut write_index_out, U8ArrayOut kernel_counters_out,
                          U8ArrayOut slot_counters_out, ffi::RemainingRets extra, VerifyAttrs attrs) {
  // built in place (aggregate initialisation): no Array is copied on the launch path
  const VerifyCall c{log_call(canary, nullptr, ring, write_index, kernel_counters, slot_counters, ring_out,
                              write_index_out, kernel_counters_out, slot_counters_out, attrs.tag),
                     array_of(slots),
                     array_of(tokens),
                     array_of(positions),
                     array_of(prevs),
                     array_of(num_valid),
                     array_of(enable),
                     attrs.check_token,
                     sources_call(srcs, attrs)};
  if (const std::string e = check_verify(c); !e.empty()) return refused(e);
  const ffi::Error err = alias_log<P>(ctx, ring, write_index, kernel_counters, slot_counters, ring_out,
                                      write_index_out, kernel_counters_out, slot_counters_out);
  if (err.failure()) return err;
  return P::verify(ctx, verify_args(c), c.slots.dim0, num_valid.typed_data(), enable.typed_data(), log_view(c.log),
                   scratch_view(extra));
}

// ---- WRITE ---------------------------------------------------------------------------------------
// kvcanary_write(canary, ring, write_index, kernel_counters, slot_counters, chain_assert_flag,
//                offsets, seed_slot_indices, num_valid_reqs, input_ids, positions, out_cache_loc,
//                expected_tokens, expected_positions, *sources)
//   -> (canary, ring, write_index, kernel_counters, slot_counters[, scratch on CUDA])
//   attrs (WriteAttrs): tag:i64, input_assert:bool, mode:i32, page_size/bytes_per_token/read_bytes/offset_bytes: i64[4]
template <class P>
auto write_binding() {
  auto args = log_args(ffi::Ffi::Bind().template Ctx<typename P::Context>().template Arg<U8Array>())  // canary
                  .template Arg<I32Scalar>()       // enable_chain_position_assert
                  .template Arg<ffi::AnyBuffer>()  // offsets
                  .template Arg<ffi::AnyBuffer>()  // seed_slot_indices
                  .template Arg<I32Scalar>()       // num_valid_reqs
                  .template Arg<ffi::AnyBuffer>()  // input_ids
                  .template Arg<ffi::AnyBuffer>()  // positions
                  .template Arg<ffi::AnyBuffer>()  // out_cache_loc
                  .template Arg<ffi::AnyBuffer>()  // expected_input_tokens (length 0 when the assert is off)
                  .template Arg<ffi::AnyBuffer>()  // expected_input_positions (likewise)
                  .RemainingArgs();                // real-KV sources
  return log_results(std::move(args).template Ret<U8Array>())  // canary
      .RemainingRets()
      .template Attrs<WriteAttrs>();
}

template <class P>
ffi::Error write_handler(typename P::Ctx ctx, U8Array canary, U8Array ring, I32Scalar write_index,
                         U8Array kernel_counters, U8Array slot_counters, I32Scalar chain_flag,
                         ffi::AnyBuffer offsets, ffi::AnyBuffer seeds, I32Scalar num_valid_reqs,
                         ffi::AnyBuffer input_ids, ffi::AnyBuffer positions, ffi::AnyBuffer locs,
                         ffi::AnyBuffer exp_tokens, ffi::AnyBuffer exp_positions, ffi::RemainingArgs srcs,
                         U8ArrayOut canary_out, U8ArrayOut ring_out, I32ScalarOut write_index_out,
                         U8ArrayOut kernel_counters_out, U8ArrayOut slot_counters_out, ffi::RemainingRets extra,
                         WriteAttrs attrs) {
  const WriteCall c{log_call(*canary_out, &canary, ring, write_index, kernel_counters, slot_counters, ring_out,
                             write_index_out, kernel_counters_out, slot_counters_out, attrs.tag),
                    array_of(chain_flag),
                    array_of(offsets),
                    array_of(seeds),
                    array_of(num_valid_reqs),
                    array_of(input_ids),
                    array_of(positions),
                    array_of(locs),
                    array_of(exp_tokens),
                    array_of(exp_positions),
                    attrs.input_assert,
                    sources_call(srcs, attrs)};
  if (const std::string e = check_write(c); !e.empty()) return refused(e);
  ffi::Error err = alias_in<P>(ctx, canary, canary_out);
  if (err.success())
    err = alias_log<P>(ctx, ring, write_index, kernel_counters, slot_counters, ring_out, write_index_out,
                       kernel_counters_out, slot_counters_out);
  if (err.failure()) return err;
  return P::write(ctx, write_args(c), index_view(c.offsets), c.seeds.dim0, c.input_ids.dim0,
                  num_valid_reqs.typed_data(), chain_flag.typed_data(), log_view(c.log), scratch_view(extra));
}

// ---- PLAN ----------------------------------------------------------------------------------------
// kvcanary_plan(req_pool_indices, prefix_lens, extend_seq_lens, req_to_token, lut, pool, valid_lens,
//               row_starts)
//   -> (slot_indices, expected_tokens, expected_positions, prev_slot_indices, num_valid, enable,
//       offsets, seed_slot_indices, num_valid_reqs[, scratch on CUDA])   all int32 but scratch
//   attrs (PlanAttrs): window:i64, token_offset:i64, has_lut:bool, has_pool:bool, has_row_starts:bool,
//                      report_evicted:bool
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
      .RemainingRets()
      .template Attrs<PlanAttrs>();
}

template <class P>
ffi::Error plan_handler(typename P::Ctx ctx, ffi::AnyBuffer rpi, ffi::AnyBuffer prefix, ffi::AnyBuffer extend,
                        ffi::AnyBuffer r2t, ffi::AnyBuffer lut, ffi::AnyBuffer pool, ffi::AnyBuffer valid_lens,
                        ffi::AnyBuffer row_starts, I32VectorOut slots, I32VectorOut tokens, I32VectorOut positions,
                        I32VectorOut prevs, I32ScalarOut num_valid, I32ScalarOut enable, I32VectorOut offsets,
                        I32VectorOut seeds, I32ScalarOut num_valid_reqs, ffi::RemainingRets extra, PlanAttrs attrs) {
  const PlanCall c{array_of(rpi),        array_of(prefix),     array_of(extend),    array_of(r2t),
                   array_of(lut),        array_of(pool),       array_of(valid_lens), array_of(row_starts),
                   array_of(*slots),     array_of(*tokens),    array_of(*positions), array_of(*prevs),
                   array_of(*num_valid), array_of(*enable),    array_of(*offsets),  array_of(*seeds),
                   array_of(*num_valid_reqs),
                   attrs.window,         attrs.token_offset,   attrs.has_lut,       attrs.has_pool,
                   attrs.has_row_starts, attrs.report_evicted};
  if (const std::string e = check_plan(c); !e.empty()) return refused(e);
  return P::plan(ctx, plan_args(c), c.rpi.dim0, c.slots.elements, c.seeds.elements, plan_out(c), scratch_view(extra));
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
  const ScatterCall c{array_of(pool), array_of(flat_ids), array_of(offsets), array_of(rpi), array_of(*pool_out)};
  if (const std::string e = check_scatter(c); !e.empty()) return refused(e);
  const ffi::Error err = alias_in<P>(ctx, pool, pool_out);
  if (err.failure()) return err;
  const int64_t rows = c.pool.dim0, cols = c.pool.dim1;
  if (c.pool.type == ElemType::S64)
    return P::scatter(ctx, static_cast<int64_t*>(c.result.data), rows, cols, index_view(c.flat_ids), c.flat_ids.dim0,
                      index_view(c.offsets), index_view(c.rpi), c.rpi.dim0);
  return P::scatter(ctx, static_cast<int32_t*>(c.result.data), rows, cols, index_view(c.flat_ids), c.flat_ids.dim0,
                    index_view(c.offsets), index_view(c.rpi), c.rpi.dim0);
}

}  // namespace kvcanary
