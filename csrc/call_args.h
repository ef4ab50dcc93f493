// call_args.h: the buffers and attributes of one op call as plain descriptions (no XLA types), each
// op's argument check, and the launch arguments of a call the check accepted.
//
// The FFI targets are registered for the whole process, so exported HLO or a direct
// jax.ffi.ffi_call reaches a handler without the Python checks. A handler (ffi_handlers.h) therefore
// describes what XLA gave it as a *Call, runs the op's check (check_verify, check_write, check_plan,
// check_scatter) and launches only what the check accepted. A check reads shapes, dtypes and
// attributes, never data (data is bounded by the core, docs/format.md), and returns "" or a
// "kv-canary: <target>: ..." message naming the argument, the expected and the actual value. The
// sanitized fuzz driver (tests/native) builds calls with random shapes and attributes, runs the same
// checks and launches what they accept on buffers of exactly the described sizes.
#pragma once

#include <cstdint>
#include <string>

#include "canary_core.h"

namespace kvcanary {

enum class ElemType { OTHER, U8, S32, S64 };

// One buffer: its data, element type, rank, first two dimensions (0 where the rank has none), element
// count and size in bytes.
struct Array {
  void* data = nullptr;
  ElemType type = ElemType::OTHER;
  int64_t rank = 0;
  int64_t dim0 = 0, dim1 = 0;
  int64_t elements = 0;
  int64_t bytes = 0;
};

// The real-KV attributes (format.md §4.4): the mode and the geometry of each source.
struct RealKvAttrs {
  int32_t mode = 0;
  int64_t entries = 0;  // geometry entries given: the shortest of the four arrays, at most MAX_REAL_KV_SOURCES
  // (a handler copies the entries of the sources given, and none with mode NONE: nothing reads more)
  int64_t page_size[MAX_REAL_KV_SOURCES] = {};
  int64_t bytes_per_token[MAX_REAL_KV_SOURCES] = {};
  int64_t read_bytes[MAX_REAL_KV_SOURCES] = {};
  int64_t offset_bytes[MAX_REAL_KV_SOURCES] = {};
};

// A call's real-KV sources: `count` trailing operands, of which the first MAX_REAL_KV_SOURCES are
// described (a call with more is refused).
struct SourcesCall {
  Array src[MAX_REAL_KV_SOURCES];
  int64_t count = 0;
  bool all_buffers = true;  // every trailing operand is a buffer
  RealKvAttrs attrs;
};

// The canary, the violation log's four buffers (format.md §3.3) and the launch tag. The buffers are the
// results the launcher reads and writes (XLA aliases them to the inputs); `results_match_inputs` says
// each has the shape of the input it aliases.
struct LogCall {
  Array canary, ring, write_index, kernel_counters, slot_counters;
  int64_t tag = 0;
  bool results_match_inputs = true;
};

struct VerifyCall {
  LogCall log;
  Array slots, tokens, positions, prevs, num_valid, enable;
  bool check_token = false;
  SourcesCall sources;
};

struct WriteCall {
  LogCall log;
  Array chain_flag, offsets, seeds, num_valid_reqs, input_ids, positions, locs, exp_tokens, exp_positions;
  bool input_assert = false;
  SourcesCall sources;
};

struct PlanCall {
  Array rpi, prefix, extend, r2t, lut, pool, valid_lens, row_starts;                        // operands
  Array slots, tokens, positions, prevs, num_valid, enable, offsets, seeds, num_valid_reqs;  // results
  int64_t window = 0, token_offset = 0;
  bool has_lut = false, has_pool = false, has_row_starts = false, report_evicted = false;
};

struct ScatterCall {
  Array pool, flat_ids, offsets, rpi, result;
};

// Bytes per row of a real-KV source (its leading dimension is the row); 0 without rows.
inline int64_t row_bytes_of(const Array& a) { return a.dim0 > 0 ? a.bytes / a.dim0 : 0; }

// ---- checks ------------------------------------------------------------------------------------------
// Collects the first failure of a call's checks.
class CallCheck {
 public:
  explicit CallCheck(const char* op) : op_(op) {}
  const std::string& error() const { return error_; }
  bool ok() const { return error_.empty(); }

  static std::string num(int64_t v) { return std::to_string(v); }

  void fail(const std::string& what) {
    if (ok()) error_ = std::string("kv-canary: ") + op_ + ": " + what;
  }
  // A fixed message; a message built from values is built only on failure (`if (!cond) fail(...)`),
  // so that an accepted call allocates nothing.
  void require(bool cond, const char* what) {
    if (!cond) fail(what);
  }

  // An index buffer: int32 or int64, of rank `rank`.
  void index_rank(const char* name, const Array& a, int64_t rank) {
    if (a.type != ElemType::S32 && a.type != ElemType::S64)
      fail(std::string(name) + " must have dtype int32 or int64");
    else if (a.rank != rank)
      fail(std::string(name) + " must be " + num(rank) + "-D, got rank " + num(a.rank));
  }
  // An index array: int32 or int64, 1-D, `len` long (any length when len < 0).
  void index(const char* name, const Array& a, int64_t len) {
    index_rank(name, a, 1);
    if (ok() && len >= 0 && a.dim0 != len)
      fail(std::string(name) + " length must be " + num(len) + ", got " + num(a.dim0));
  }
  // A buffer of dtype `type` holding exactly n elements.
  void count(const char* name, const Array& a, ElemType type, int64_t n) {
    if (a.type != type)
      fail(std::string(name) + " has the wrong dtype");
    else if (a.elements != n)
      fail(std::string(name) + " must hold " + num(n) + " element(s), got " + num(a.elements));
  }

  // The canary, the log's four buffers and the launch tag (verify, write).
  void log(const LogCall& c) {
    require(c.results_match_inputs, "the canary and log results must have the shapes of the inputs they alias");
    const int64_t slots = c.canary.dim0, stride = c.canary.dim1;
    require(c.canary.type == ElemType::U8 && c.canary.rank == 2, "canary must be a uint8 [num_slots, stride] array");
    if (!ok()) return;
    if (slots < 1) fail("canary must have at least 1 slot, got " + num(slots));
    if (stride < CANARY_SLOT_BYTES || stride % 8 != 0)
      fail("canary slot stride must be a multiple of 8 bytes and at least 32, got " + num(stride));
    if (!(c.ring.type == ElemType::U8 && c.ring.rank == 2 && c.ring.dim0 >= 1 && c.ring.dim1 == VIOLATION_ROW_BYTES))
      fail("log.ring must be [capacity >= 1, 64] bytes, got [" + num(c.ring.dim0) + ", " + num(c.ring.dim1) + "]");
    count("log.write_index", c.write_index, ElemType::S32, 1);
    const Array &k = c.kernel_counters, &s = c.slot_counters;
    const int64_t tags = k.dim0;
    if (!(k.type == ElemType::U8 && s.type == ElemType::U8 && k.rank == 2 && s.rank == 2 && tags >= 1 &&
          k.dim1 == COUNTER_BYTES && s.dim0 == tags && s.dim1 == COUNTER_BYTES))
      fail("log counters must both be [num_tags >= 1, 8] bytes, got [" + num(tags) + ", " + num(k.dim1) + "] and [" +
           num(s.dim0) + ", " + num(s.dim1) + "]");
    if (ok() && (c.tag < 0 || c.tag >= tags)) fail("tag must be in [0, " + num(tags) + "), got " + num(c.tag));
  }

  // The real-KV mode, sources and their geometry (format.md §4.4): a source whose strip would reach
  // past its row is refused rather than read (a source without rows is never read: every slot of it
  // is out of range).
  void sources(const SourcesCall& c) {
    const RealKvAttrs& g = c.attrs;
    if (g.mode < 0 || g.mode > 2) return fail("mode must be 0 (NONE), 1 (PARTIAL) or 2 (ALL), got " + num(g.mode));
    if (c.count > MAX_REAL_KV_SOURCES) return fail("at most 4 real-KV sources, got " + num(c.count));
    if (g.mode == static_cast<int32_t>(RealKvHashMode::NONE)) return;
    if (!c.all_buffers) return fail("every real-KV source must be a buffer");
    if (g.entries < c.count)
      return fail("the geometry attributes must have an entry for each of the " + num(c.count) + " sources");
    for (int64_t k = 0; k < c.count && ok(); ++k) {
      const int64_t rows = c.src[k].dim0, row_bytes = row_bytes_of(c.src[k]);
      const int64_t ps = g.page_size[k], bpt = g.bytes_per_token[k], off = g.offset_bytes[k];
      const bool partial = g.mode == static_cast<int32_t>(RealKvHashMode::PARTIAL);
      const int64_t eff = partial ? REAL_KV_PARTIAL_BYTES : g.read_bytes[k];
      const bool fits = ps >= 1 && bpt > 0 && bpt % REAL_KV_CHUNK_BYTES == 0 && eff > 0 &&
                        eff % REAL_KV_CHUNK_BYTES == 0 && eff <= bpt && off >= 0 && off % REAL_KV_CHUNK_BYTES == 0 &&
                        off <= bpt - eff && (rows == 0 || ps <= row_bytes / bpt);
      if (!fits)
        fail("real-KV source " + num(k) + " geometry (page_size " + num(ps) + ", bytes_per_token " + num(bpt) +
             ", read " + num(eff) + " bytes at offset " + num(off) + ") does not fit its rows of " +
             num(row_bytes) + " bytes");
    }
  }

 private:
  const char* op_;
  std::string error_;
};

inline std::string check_verify(const VerifyCall& c) {
  CallCheck k("kvcanary_verify");
  const int64_t cap = c.slots.dim0;
  k.log(c.log);
  k.index("slot_indices", c.slots, -1);
  if (k.ok()) k.require(cap >= 1, "verify capacity must be positive, got 0");
  k.index("expected_tokens", c.tokens, cap);
  k.index("expected_positions", c.positions, cap);
  k.index("prev_slot_indices", c.prevs, cap);
  k.count("num_valid", c.num_valid, ElemType::S32, 1);
  k.count("enable", c.enable, ElemType::S32, 1);
  k.sources(c.sources);
  return k.error();
}

inline std::string check_write(const WriteCall& c) {
  CallCheck k("kvcanary_write");
  const int64_t reqs = c.seeds.dim0, n = c.input_ids.dim0;
  // the expected arrays are read only with the input assert (Python passes empty ones without it)
  const int64_t expected_len = c.input_assert ? n : -1;
  k.log(c.log);
  k.count("enable_chain_position_assert", c.chain_flag, ElemType::S32, 1);
  k.index("seed_slot_indices", c.seeds, -1);
  k.index("offsets", c.offsets, reqs + 1);
  k.count("num_valid_reqs", c.num_valid_reqs, ElemType::S32, 1);
  k.index("input_ids", c.input_ids, -1);
  k.index("positions", c.positions, n);
  k.index("out_cache_loc", c.locs, n);
  k.index("expected_input_tokens", c.exp_tokens, expected_len);
  k.index("expected_input_positions", c.exp_positions, expected_len);
  k.sources(c.sources);
  return k.error();
}

inline std::string check_plan(const PlanCall& c) {
  CallCheck k("kvcanary_plan");
  const int64_t bs = c.rpi.dim0;
  const int64_t vcap = c.slots.elements, wcap = c.seeds.elements;
  using N = CallCheck;
  k.index("req_pool_indices", c.rpi, -1);
  k.index("prefix_lens", c.prefix, bs);
  k.index("extend_seq_lens", c.extend, bs);
  if (c.has_row_starts) {
    k.index("req_to_token (a flat table with row_starts)", c.r2t, -1);
    k.index("row_starts", c.row_starts, bs);
  } else {
    k.index_rank("req_to_token", c.r2t, 2);
  }
  if (c.has_lut) {
    k.index("full_to_swa_index_mapping", c.lut, -1);
    if (k.ok()) k.require(c.lut.dim0 >= 1, "full_to_swa_index_mapping length must be >= 1, got 0");
  }
  k.require(c.has_lut || c.window <= 0, "a window > 0 needs full_to_swa_index_mapping (has_lut)");
  k.require(c.has_lut || !c.report_evicted, "report_evicted needs full_to_swa_index_mapping (has_lut)");
  if (c.window < 0) k.fail("window must be >= 0, got " + N::num(c.window));
  if (c.token_offset < INT32_MIN || c.token_offset > INT32_MAX)
    k.fail("token_offset must fit in int32, got " + N::num(c.token_offset));
  if (c.has_pool) {
    k.index_rank("req_to_verify_expected_tokens", c.pool, 2);
    k.index("req_to_verify_expected_tokens_valid_lens", c.valid_lens, bs);
  }
  for (const Array* out : {&c.slots, &c.tokens, &c.positions, &c.prevs, &c.offsets, &c.seeds})
    k.require(out->type == ElemType::S32 && out->rank == 1, "every plan result must be a 1-D int32 array");
  k.require(vcap >= 1, "the verify entry results must hold >= 1 entry, got 0");
  if (c.tokens.elements != vcap || c.positions.elements != vcap || c.prevs.elements != vcap)
    k.fail("the four verify entry results must have the same length " + N::num(vcap));
  if (bs > wcap) k.fail("bs=" + N::num(bs) + " exceeds the write request results' " + N::num(wcap));
  if (c.offsets.elements != wcap + 1)
    k.fail("the offsets result must hold " + N::num(wcap + 1) + " entries, got " + N::num(c.offsets.elements));
  k.count("num_valid", c.num_valid, ElemType::S32, 1);
  k.count("enable", c.enable, ElemType::S32, 1);
  k.count("num_valid_reqs", c.num_valid_reqs, ElemType::S32, 1);
  return k.error();
}

inline std::string check_scatter(const ScatterCall& c) {
  CallCheck k("kvcanary_scatter");
  k.index_rank("pool", c.pool, 2);
  k.index("flat_ids", c.flat_ids, -1);
  k.index("req_pool_indices", c.rpi, -1);
  k.index("offsets", c.offsets, c.rpi.dim0 + 1);
  k.require(c.result.type == c.pool.type && c.result.bytes == c.pool.bytes,
            "the result must have the pool's dtype and shape");
  return k.error();
}

// ---- launch arguments of an accepted call --------------------------------------------------------------
inline IndexView index_view(const Array& a) { return IndexView{a.data, a.type == ElemType::S64}; }

inline CanaryView canary_view(const Array& a) { return CanaryView{static_cast<uint8_t*>(a.data), a.dim0, a.dim1}; }

inline LogView log_view(const LogCall& c) {
  return LogView{static_cast<uint8_t*>(c.ring.data), c.ring.dim0, static_cast<int32_t*>(c.write_index.data),
                 static_cast<uint8_t*>(c.kernel_counters.data), static_cast<uint8_t*>(c.slot_counters.data)};
}

// Rows and row bytes come from the buffer itself, so they cannot disagree with what is mapped; the
// core still treats a geometry that would reach past a row as a source without rows
// (make_source_view in canary_core.h).
inline RealKvSources real_kv_sources(const SourcesCall& c) {
  RealKvSources out{};
  out.mode = static_cast<int32_t>(RealKvHashMode::NONE);
  out.count = 0;
  if (c.attrs.mode == static_cast<int32_t>(RealKvHashMode::NONE) || c.count == 0) return out;
  out.mode = c.attrs.mode;
  for (int64_t k = 0; k < c.count; ++k) {
    const Array& s = c.src[k];
    out.src[out.count++] = make_source_view(static_cast<const uint8_t*>(s.data), s.dim0, row_bytes_of(s),
                                            c.attrs.page_size[k], c.attrs.bytes_per_token[k], c.attrs.read_bytes[k],
                                            c.attrs.offset_bytes[k], c.attrs.mode);
  }
  return out;
}

inline VerifyArgs verify_args(const VerifyCall& c) {
  VerifyArgs a{};
  a.canary = canary_view(c.log.canary);
  a.slots = index_view(c.slots);
  a.tokens = index_view(c.tokens);
  a.positions = index_view(c.positions);
  a.prevs = index_view(c.prevs);
  a.check_token = c.check_token;
  a.sources = real_kv_sources(c.sources);
  a.tag = c.log.tag;
  return a;
}

// a.chain_assert stays false: it is a buffer value (chain_flag), which the launcher reads.
inline WriteArgs write_args(const WriteCall& c) {
  WriteArgs a{};
  a.canary = canary_view(c.log.canary);
  a.seeds = index_view(c.seeds);
  a.input_ids = index_view(c.input_ids);
  a.positions = index_view(c.positions);
  a.locs = index_view(c.locs);
  a.exp_tokens = index_view(c.exp_tokens);
  a.exp_positions = index_view(c.exp_positions);
  a.input_assert = c.input_assert;
  a.chain_assert = false;
  a.sources = real_kv_sources(c.sources);
  a.tag = c.log.tag;
  return a;
}

inline PlanArgs plan_args(const PlanCall& c) {
  PlanArgs a{};
  a.req_pool_indices = index_view(c.rpi);
  a.prefix_lens = index_view(c.prefix);
  a.extend_seq_lens = index_view(c.extend);
  a.req_to_token = index_view(c.r2t);
  a.has_row_starts = c.has_row_starts;
  a.row_starts = index_view(c.row_starts);
  a.N = c.has_row_starts ? c.r2t.dim0 : 0;
  a.R = c.r2t.rank == 2 ? c.r2t.dim0 : 0;
  a.L = c.r2t.rank == 2 ? c.r2t.dim1 : 0;
  a.has_lut = c.has_lut;
  a.lut = index_view(c.lut);
  a.lut_len = c.lut.dim0;
  a.has_pool = c.has_pool;
  a.pool = index_view(c.pool);
  a.Rp = c.pool.dim0;
  a.Cp = c.pool.dim1;
  a.valid_lens = index_view(c.valid_lens);
  a.window = c.window;
  a.token_offset = c.token_offset;
  a.report_evicted = c.report_evicted;
  return a;
}

inline PlanOut plan_out(const PlanCall& c) {
  const auto i32 = [](const Array& a) { return static_cast<int32_t*>(a.data); };
  return PlanOut{i32(c.slots),     i32(c.tokens),  i32(c.positions), i32(c.prevs),         i32(c.num_valid),
                 i32(c.enable),    i32(c.offsets), i32(c.seeds),     i32(c.num_valid_reqs)};
}

}  // namespace kvcanary
