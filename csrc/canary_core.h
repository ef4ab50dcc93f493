// canary_core.h: ALL per-entry logic of jax_kvcanary, shared by the CPU launchers (g++) and the CUDA
// kernels (nvcc). Nothing here allocates, syncs or knows about XLA: the launchers own the loops,
// the ring append protocol and the buffers. Section numbers (§) refer to docs/format.md.
//
// Every integer constant and enum repeats src/jax_kvcanary/consts.py; the modules report them
// (registrations.h: constants()) and jax_kvcanary/_ffi.py refuses a module whose values differ.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

// Every core function is inlined into its launcher on both sides (as __forceinline__ does on the
// device): the launchers specialise the per-launch flags of the argument structs (cpu_launchers.h), which
// only folds away when the per-entry code is inlined into the loop.
#if defined(__CUDACC__)
#define KVC_HD __host__ __device__ __forceinline__
#elif defined(__GNUC__)
#define KVC_HD inline __attribute__((always_inline))
#else
#define KVC_HD inline
#endif

#if !defined(__CUDA_ARCH__) && defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "jax_kvcanary stores little-endian records; big-endian hosts are not supported"
#endif

namespace kvcanary {

// ---- constants (format.md §2.1) ---------------------------------------------------------------------
constexpr uint64_t CANARY_CHAIN_ANCHOR = 0xC0FFEE1234567890ull;
constexpr uint64_t CANARY_ANCHOR_HASH = 0xDE7FAE23A9A1B716ull;
constexpr uint64_t SPLITMIX64_MUL1 = 0xBF58476D1CE4E5B9ull;
constexpr uint64_t SPLITMIX64_MUL2 = 0x94D049BB133111EBull;
constexpr int SPLITMIX64_SHIFT1 = 30;
constexpr int SPLITMIX64_SHIFT2 = 27;
constexpr int SPLITMIX64_SHIFT3 = 31;
constexpr int64_t REQ_POOL_IDX_PADDING = 0;
constexpr int64_t TOKEN_TO_KV_SLOT_PADDING = 0;
constexpr int64_t CANARY_FIELDS_PER_SLOT = 4;
constexpr int64_t CANARY_FIELD_TOKEN = 0;
constexpr int64_t CANARY_FIELD_POSITION = 1;
constexpr int64_t CANARY_FIELD_PREV_HASH = 2;
constexpr int64_t CANARY_FIELD_REAL_KV_HASH = 3;
constexpr int64_t CANARY_SLOT_BYTES = 32;
constexpr int64_t VIOLATION_FIELDS = 8;
constexpr int64_t VIOLATION_FIELD_KERNEL_KIND = 0;
constexpr int64_t VIOLATION_FIELD_SLOT_IDX = 1;
constexpr int64_t VIOLATION_FIELD_POSITION = 2;
constexpr int64_t VIOLATION_FIELD_STORED_TOKEN = 3;
constexpr int64_t VIOLATION_FIELD_EXPECTED_TOKEN = 4;
constexpr int64_t VIOLATION_FIELD_STORED_CHAIN_HASH = 5;
constexpr int64_t VIOLATION_FIELD_EXPECTED_AUX = 6;
constexpr int64_t VIOLATION_FIELD_FAIL_REASON_BITS = 7;
constexpr int64_t VIOLATION_ROW_BYTES = 64;
constexpr int64_t COUNTER_BYTES = 8;
constexpr int64_t MAX_REAL_KV_SOURCES = 4;
constexpr int64_t REAL_KV_SOURCE_FIELDS_PER_ENTRY = 3;
constexpr int64_t REAL_KV_SOURCE_FIELD_PAGE_SIZE = 0;
constexpr int64_t REAL_KV_SOURCE_FIELD_NUM_BYTES_PER_TOKEN = 1;
constexpr int64_t REAL_KV_SOURCE_FIELD_READ_BYTES = 2;
constexpr int64_t REAL_KV_CHUNK_BYTES = 16;
constexpr int64_t REAL_KV_PARTIAL_BYTES = 16;
constexpr int64_t NUM_LAUNCH_TAGS = 12;
constexpr int64_t DEFAULT_RING_CAPACITY = 1024;
constexpr int64_t WRITE_INDEX_MAX = 2147483647;

// ---- enums (format.md §2.2-§2.5) --------------------------------------------------------------------
enum class FailReason : int64_t {
  VERIFY_CHAIN_HASH_MISMATCH = 1,
  VERIFY_POSITION_MISMATCH = 2,
  VERIFY_REAL_KV_HASH_MISMATCH = 4,
  WRITE_TOKEN_MISMATCH = 8,
  WRITE_POSITION_MISMATCH = 16,
  VERIFY_TOKEN_MISMATCH = 32,
  INDEX_OUT_OF_RANGE = 64,
};

enum class LaunchTag : int64_t {
  HEAD_K_FULL = 0,
  HEAD_V_FULL = 1,
  TAIL_K_FULL = 2,
  TAIL_V_FULL = 3,
  SWEEP_K_FULL = 4,
  SWEEP_V_FULL = 5,
  HEAD_K_SWA = 6,
  HEAD_V_SWA = 7,
  TAIL_K_SWA = 8,
  TAIL_V_SWA = 9,
  SWEEP_K_SWA = 10,
  SWEEP_V_SWA = 11,
};

enum class RealKvHashMode : int32_t {
  NONE = 0,
  PARTIAL = 1,
  ALL = 2,
};

enum class IndexKind : int64_t {
  WRITE_SLOT = 1,
  WRITE_SEED = 2,
  VERIFY_SLOT = 3,
  VERIFY_PREV = 4,
  REAL_KV_SOURCE_0 = 16,
  REAL_KV_SOURCE_1 = 17,
  REAL_KV_SOURCE_2 = 18,
  REAL_KV_SOURCE_3 = 19,
};

KVC_HD int64_t bits(FailReason r) { return static_cast<int64_t>(r); }
KVC_HD int64_t code(IndexKind k) { return static_cast<int64_t>(k); }

// ---- hashing (format.md §4.1-§4.3) ------------------------------------------------------------------
KVC_HD uint64_t splitmix64(uint64_t x) {
  x = (x ^ (x >> SPLITMIX64_SHIFT1)) * SPLITMIX64_MUL1;
  x = (x ^ (x >> SPLITMIX64_SHIFT2)) * SPLITMIX64_MUL2;
  return x ^ (x >> SPLITMIX64_SHIFT3);
}

// Order-sensitive chain step: mix3(prev_hash, token, position).
KVC_HD uint64_t mix3(uint64_t a, uint64_t b, uint64_t c) {
  uint64_t h = splitmix64(a);
  h = splitmix64(h ^ b);
  return splitmix64(h ^ c);
}

// ---- little-endian 64-bit loads/stores on byte buffers -----------------------------------------
// Every 64-bit field the core touches is 8-byte aligned: XLA buffers are at least 16-byte aligned,
// canary strides are multiples of 8 (checked at trace time), ring rows are 64 bytes, counter rows 8
// bytes and real-KV chunk offsets multiples of 16 (format.md §3, §4.4). On the device a memcpy through a
// uint8_t* compiles to eight byte loads, so the device path states that alignment (one 8-byte
// access); the CUDA launchers check the buffer bases once on the host. Host code keeps memcpy.
KVC_HD int64_t load_i64(const uint8_t* p) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const int64_t*>(p);
#else
  int64_t v;
  memcpy(&v, p, sizeof(v));
  return v;
#endif
}
KVC_HD uint64_t load_u64(const uint8_t* p) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const uint64_t*>(p);
#else
  uint64_t v;
  memcpy(&v, p, sizeof(v));
  return v;
#endif
}
KVC_HD void store_i64(uint8_t* p, int64_t v) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<int64_t*>(p) = v;
#else
  memcpy(p, &v, sizeof(v));
#endif
}

// ---- index arrays: int32 or int64, widened on read ---------------------------------------------
struct IndexView {
  const void* data;
  bool is64;
  KVC_HD int64_t operator[](int64_t i) const {
    return is64 ? static_cast<const int64_t*>(data)[i]
                : static_cast<int64_t>(static_cast<const int32_t*>(data)[i]);
  }
};

KVC_HD int64_t clamp64(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : (x > hi ? hi : x); }
// Wrap-around int64 arithmetic without signed-overflow UB.
KVC_HD int64_t add_wrap(int64_t a, int64_t b) {
  return static_cast<int64_t>(static_cast<uint64_t>(a) + static_cast<uint64_t>(b));
}
KVC_HD int64_t sub_wrap(int64_t a, int64_t b) {
  return static_cast<int64_t>(static_cast<uint64_t>(a) - static_cast<uint64_t>(b));
}

// ---- canary records (format.md §3.1) ----------------------------------------------------------------
struct Record {
  int64_t token, position, prev_hash, real_kv_hash;
};

// The chain hash a record hands to its successor (format.md §4.2).
KVC_HD uint64_t record_successor(const Record& r) {
  return mix3(static_cast<uint64_t>(r.prev_hash), static_cast<uint64_t>(r.token), static_cast<uint64_t>(r.position));
}

struct CanaryView {
  uint8_t* data;  // [num_slots, stride]
  int64_t num_slots;
  int64_t stride;
  KVC_HD const uint8_t* slot_ptr(int64_t s) const { return data + s * stride; }
  KVC_HD Record load(int64_t s) const {  // caller guarantees 0 <= s < num_slots
    const uint8_t* p = slot_ptr(s);
    return Record{load_i64(p), load_i64(p + 8), load_i64(p + 16), load_i64(p + 24)};
  }
  KVC_HD void store(int64_t s, const Record& r) const {
    uint8_t* p = data + s * stride;
    store_i64(p, r.token);
    store_i64(p + 8, r.position);
    store_i64(p + 16, r.prev_hash);
    store_i64(p + 24, r.real_kv_hash);
  }
  // successor_hash(s): anchor hash for any s < 0; caller guarantees s < num_slots.
  KVC_HD uint64_t successor_hash(int64_t s) const {
    return s < 0 ? splitmix64(CANARY_CHAIN_ANCHOR) : record_successor(load(s));
  }
};

// ---- real-KV sources (format.md §4.4) ---------------------------------------------------------------
struct RealKvSourceView {
  const uint8_t* data;  // rows x row_bytes, row-major, advanced by offset_bytes: the strip of slot 0
  int64_t rows;
  int64_t row_bytes;
  int64_t page_size;
  int64_t bytes_per_token;
  int64_t read_bytes;
};

// A source view that is safe to address (format.md §4.4). The Python checks guarantee page_size >= 1,
// 16 | eff, 16 | offset_bytes, offset_bytes + eff <= num_bytes_per_token and
// page_size * num_bytes_per_token <= row_bytes, so every strip of a slot with row < rows lies inside
// the buffer: its last byte is at column (page_size - 1) * num_bytes_per_token + offset_bytes + eff
// - 1 < page_size * num_bytes_per_token. Geometry that breaks them anyway (never produced by the
// Python checks) would reach past a row: it gets zero rows, so every slot is unaddressable (an
// INDEX_OUT_OF_RANGE row) and no byte of it is ever read. No multiplication or addition here can
// overflow.
//
// offset_bytes is folded into `data` here, once per launch, so the per-slot address
// data + row * row_bytes + (slot % page_size) * bytes_per_token is the buffer's byte
// row * row_bytes + (slot % page_size) * bytes_per_token + offset_bytes without a per-slot add (and the
// view, which the CUDA kernels take by value, does not grow). The pointer moves only when the view
// has rows, so it stays inside the buffer, 16-byte aligned when the buffer is.
KVC_HD RealKvSourceView make_source_view(const uint8_t* data, int64_t rows, int64_t row_bytes, int64_t page_size,
                                         int64_t bytes_per_token, int64_t read_bytes, int64_t offset_bytes,
                                         int32_t mode) {
  RealKvSourceView v{};
  v.data = data;
  v.rows = rows > 0 ? rows : 0;
  v.row_bytes = row_bytes;
  v.page_size = page_size > 0 ? page_size : 1;
  v.bytes_per_token = bytes_per_token;
  v.read_bytes = read_bytes;
  const int64_t eff = mode == static_cast<int32_t>(RealKvHashMode::PARTIAL) ? REAL_KV_PARTIAL_BYTES : read_bytes;
  const bool sane = page_size > 0 && bytes_per_token > 0 && eff > 0 && eff % REAL_KV_CHUNK_BYTES == 0 &&
                    eff <= bytes_per_token && offset_bytes >= 0 && offset_bytes % REAL_KV_CHUNK_BYTES == 0 &&
                    offset_bytes <= bytes_per_token - eff && row_bytes >= 0 &&
                    page_size <= row_bytes / bytes_per_token;
  if (!sane) v.rows = 0;
  if (v.rows > 0) v.data = data + offset_bytes;
  return v;
}

struct RealKvSources {
  RealKvSourceView src[MAX_REAL_KV_SOURCES];
  int32_t count;  // 0..4; 0 whenever mode is NONE
  int32_t mode;   // RealKvHashMode; NONE whenever count is 0
  KVC_HD bool active() const { return count > 0 && mode != static_cast<int32_t>(RealKvHashMode::NONE); }
  KVC_HD int64_t fold_bytes(int k) const {
    return mode == static_cast<int32_t>(RealKvHashMode::PARTIAL) ? REAL_KV_PARTIAL_BYTES : src[k].read_bytes;
  }
  // Index of the first source whose row slot // page_size is out of range, or -1 (slot >= 0).
  KVC_HD int first_unaddressable(int64_t slot) const {
    for (int k = 0; k < count; ++k) {
      if (slot / src[k].page_size >= src[k].rows) return k;
    }
    return -1;
  }
  KVC_HD const uint8_t* strip(int k, int64_t slot) const {
    const RealKvSourceView& v = src[k];
    return v.data + (slot / v.page_size) * v.row_bytes + (slot % v.page_size) * v.bytes_per_token;
  }
  // Fold of one source's strip for an addressable slot.
  KVC_HD uint64_t fold_one(int k, int64_t slot) const {
    const uint8_t* p = strip(k, slot);
    const int64_t eff = fold_bytes(k);
    uint64_t acc = 0;
    for (int64_t off = 0; off < eff; off += REAL_KV_CHUNK_BYTES) {
      acc = splitmix64(acc ^ load_u64(p + off));
      acc = splitmix64(acc ^ load_u64(p + off + 8));
    }
    return acc;
  }
  // One step of the outer per-source fold: acc' = splitmix64(acc ^ fold_one(k, slot)), from acc = 0,
  // over k = 0..count-1 in order. (A launcher that folds the sources in parallel combines with this.)
  KVC_HD static uint64_t combine(uint64_t acc, uint64_t fold) { return splitmix64(acc ^ fold); }
  // real_kv_hash of an addressable slot (active() must hold).
  KVC_HD uint64_t hash(int64_t slot) const {
    uint64_t acc = 0;
    for (int k = 0; k < count; ++k) acc = combine(acc, fold_one(k, slot));
    return acc;
  }
};

// ---- violation rows (format.md §3.2, §5.3) ----------------------------------------------------------
struct Row {
  int64_t v[VIOLATION_FIELDS];
};

KVC_HD Row make_row(int64_t tag, int64_t slot, int64_t pos, int64_t stored_tok, int64_t exp_tok,
                    int64_t chain, int64_t aux, int64_t fail_bits) {
  return Row{{tag, slot, pos, stored_tok, exp_tok, chain, aux, fail_bits}};
}

KVC_HD Row oob_row(int64_t tag, int64_t slot, int64_t pos, int64_t tok, int64_t value, IndexKind kind,
                   int64_t bound) {
  return make_row(tag, slot, pos, tok, value, code(kind), bound, bits(FailReason::INDEX_OUT_OF_RANGE));
}

KVC_HD void store_row(uint8_t* ring, int64_t index, const Row& row) {
  uint8_t* p = ring + index * VIOLATION_ROW_BYTES;
  for (int c = 0; c < VIOLATION_FIELDS; ++c) store_i64(p + 8 * c, row.v[c]);
}

// Fill-once append (format.md §5.1): row k of a launch goes to base + k when that is inside the ring.
struct RingAppender {
  uint8_t* ring;
  int64_t capacity;
  int64_t base;  // widened write_index at launch start
  int64_t count = 0;
  KVC_HD void operator()(const Row& row) {
    const int64_t seq = add_wrap(base, count);
    if (seq >= 0 && seq < capacity) store_row(ring, seq, row);
    ++count;
  }
};

// Counts rows without storing them (count pass of a two-pass launch).
struct RowCounter {
  int64_t count = 0;
  KVC_HD void operator()(const Row&) { ++count; }
};

// write_index after a launch that produced n rows: saturating at 2^31-1 (format.md §5.1).
KVC_HD int32_t next_write_index(int64_t base, int64_t n) {
  const int64_t sum = add_wrap(base, n);
  return static_cast<int32_t>(sum > WRITE_INDEX_MAX ? WRITE_INDEX_MAX : sum);
}

// Per-tag little-endian int64 counter, wrap-around add (format.md §6).
KVC_HD void counter_add(uint8_t* counters, int64_t tag, int64_t delta) {
  uint8_t* p = counters + tag * COUNTER_BYTES;
  store_i64(p, add_wrap(load_i64(p), delta));
}

// ---- launch traits: how the per-entry functions read per-launch options and index arrays --------
// DynamicTraits reads them at run time (the CUDA kernels, the CPU's generic loop). A CPU launch whose
// index arrays all have one width instantiates FixedTraits, which fixes the width and, for "plain"
// launches (no token check, no input assert, no real-KV sources: the HEAD endpoints), those options
// at compile time, so the width branch and the disabled features fold away. The functions below are
// the same code under either traits.
struct DynamicTraits {
  KVC_HD static int64_t at(const IndexView& v, int64_t i) { return v[i]; }
  template <class Sources>
  KVC_HD static bool sources(const Sources& s) { return s.active(); }
  template <class Args>
  KVC_HD static bool check_token(const Args& a) { return a.check_token; }
  template <class Args>
  KVC_HD static bool input_assert(const Args& a) { return a.input_assert; }
};

template <bool kWide, bool kPlain>
struct FixedTraits {
  KVC_HD static int64_t at(const IndexView& v, int64_t i) {
    if constexpr (kWide) return static_cast<const int64_t*>(v.data)[i];
    else return static_cast<int64_t>(static_cast<const int32_t*>(v.data)[i]);
  }
  template <class Sources>
  KVC_HD static bool sources(const Sources& s) { return !kPlain && s.active(); }
  template <class Args>
  KVC_HD static bool check_token(const Args& a) { return !kPlain && a.check_token; }
  template <class Args>
  KVC_HD static bool input_assert(const Args& a) { return !kPlain && a.input_assert; }
};

// ---- VERIFY: one entry (format.md §8.3) -------------------------------------------------------------
struct VerifyArgs {
  CanaryView canary;
  IndexView slots, tokens, positions, prevs;
  bool check_token;
  RealKvSources sources;
  int64_t tag;
};

KVC_HD int64_t verify_active(int64_t num_valid, int64_t capacity) { return clamp64(num_valid, 0, capacity); }

// Emits the entry's rows, in order: VERIFY_PREV OOB, real-KV OOB, check row; or one VERIFY_SLOT row.
// `prev_successor`, when given, is the successor hash of the predecessor's record, taken ahead by the
// launcher (verify stores nothing, so it cannot go stale); used only for an in-range predecessor
// (0 < prev < num_slots).
template <class T = DynamicTraits, class Emit>
KVC_HD void verify_entry(const VerifyArgs& a, int64_t e, Emit& emit, const uint64_t* prev_successor = nullptr) {
  const int64_t S = a.canary.num_slots;
  const int64_t slot = T::at(a.slots, e);
  if (slot == TOKEN_TO_KV_SLOT_PADDING) return;
  const int64_t epos = T::at(a.positions, e);
  if (slot < 0 || slot >= S) {
    emit(oob_row(a.tag, slot, epos, -1, slot, IndexKind::VERIFY_SLOT, S));
    return;
  }
  const int64_t prev = T::at(a.prevs, e);
  const int64_t etok = T::check_token(a) ? T::at(a.tokens, e) : -1;
  const Record st = a.canary.load(slot);
  bool chain_checked = prev != 0;
  if (prev >= S) {
    emit(oob_row(a.tag, slot, epos, -1, prev, IndexKind::VERIFY_PREV, S));
    chain_checked = false;
  }
  int64_t exp_chain = st.prev_hash;
  if (chain_checked)  // prev < 0 (the anchor) or 0 < prev < S
    exp_chain = static_cast<int64_t>(prev > 0 && prev_successor ? *prev_successor : a.canary.successor_hash(prev));
  bool rkv_checked = true;
  int64_t exp_rkv = 0;
  if (T::sources(a.sources)) {
    const int k = a.sources.first_unaddressable(slot);
    if (k < 0) {
      exp_rkv = static_cast<int64_t>(a.sources.hash(slot));
    } else {
      emit(oob_row(a.tag, slot, epos, -1, slot / a.sources.src[k].page_size,
                   static_cast<IndexKind>(code(IndexKind::REAL_KV_SOURCE_0) + k), a.sources.src[k].rows));
      rkv_checked = false;
    }
  }
  int64_t fail = 0;
  if (chain_checked && st.prev_hash != exp_chain) fail |= bits(FailReason::VERIFY_CHAIN_HASH_MISMATCH);
  if (T::check_token(a) && etok != -1 && st.token != etok) fail |= bits(FailReason::VERIFY_TOKEN_MISMATCH);
  if (st.position != epos) fail |= bits(FailReason::VERIFY_POSITION_MISMATCH);
  if (rkv_checked && st.real_kv_hash != exp_rkv) fail |= bits(FailReason::VERIFY_REAL_KV_HASH_MISMATCH);
  if (fail) emit(make_row(a.tag, slot, st.position, st.token, etok, st.prev_hash, exp_chain, fail));
}

// ---- WRITE: one request (format.md §7.3) ------------------------------------------------------------
struct WriteArgs {
  CanaryView canary;
  IndexView seeds, input_ids, positions, locs, exp_tokens, exp_positions;
  bool input_assert;
  bool chain_assert;  // enable_chain_position_assert[0] != 0, read once per launch
  RealKvSources sources;
  int64_t tag;
};

KVC_HD int64_t write_active(int64_t num_valid_reqs, int64_t capacity) {
  return clamp64(num_valid_reqs, 0, capacity);
}

// Monotone clamp of the offsets: o[k] = clamp(max(offsets[0..k]), 0, N) (format.md §7.3). A launcher
// takes the prefix max (OffsetClamp on the host, a max-scan on the device) and clamps it here.
KVC_HD int64_t clamp_offset(int64_t running_max, int64_t num_tokens) { return clamp64(running_max, 0, num_tokens); }

// The clamped offsets one after another: next(offsets[0]) = o[0], then next(offsets[k]) = o[k].
struct OffsetClamp {
  int64_t running_max;
  int64_t num_tokens;
  KVC_HD int64_t next(int64_t offset) {
    if (offset > running_max) running_max = offset;
    return clamp_offset(running_max, num_tokens);
  }
};

// The pieces of one request, so that a parallel launcher runs the same code as the sequential loop
// below: the seed (with its OOB row), the real-KV addressability of an entry, and the rows of one
// non-skipped entry once its chain hash and its expected position are known.

// Effective seed of request r: seeds[r], or -1 after emitting the WRITE_SEED OOB row when it is >= S.
template <class T = DynamicTraits, class Emit>
KVC_HD int64_t write_seed(const WriteArgs& a, int64_t r, Emit& emit) {
  const int64_t S = a.canary.num_slots;
  int64_t seed = T::at(a.seeds, r);
  if (seed >= S) {
    emit(oob_row(a.tag, seed, -1, -1, seed, IndexKind::WRITE_SEED, S));
    seed = -1;
  }
  return seed;
}

// For a non-skipped entry (slot >= 0): the first real-KV source that cannot address the slot, or -1
// (also -1 when the slot is out of range or no fingerprint is taken). The fingerprint is taken iff
// write_takes_fingerprint().
template <class T = DynamicTraits>
KVC_HD int write_rkv_oob(const WriteArgs& a, int64_t slot) {
  if (slot >= a.canary.num_slots || !T::sources(a.sources)) return -1;
  return a.sources.first_unaddressable(slot);
}
template <class T = DynamicTraits>
KVC_HD bool write_takes_fingerprint(const WriteArgs& a, int64_t slot, int rkv_oob) {
  return slot < a.canary.num_slots && T::sources(a.sources) && rkv_oob < 0;
}

// Rows of non-skipped entry i, in order: the WRITE_SLOT or real-KV OOB row, the input-assert row,
// the chain-position row. `chain` is the running hash before the entry (the value stored as
// prev_hash); `expected_pos` is the previous non-skipped position (or the seed's stored position) + 1,
// used only when do_pos. The row count does not depend on `chain`.
template <class T = DynamicTraits, class Emit>
KVC_HD void write_entry_rows(const WriteArgs& a, int64_t i, int64_t slot, int64_t tok, int64_t pos, int rkv_oob,
                             uint64_t chain_hash, bool do_pos, int64_t expected_pos, Emit& emit) {
  const int64_t S = a.canary.num_slots;
  if (slot >= S) {
    emit(oob_row(a.tag, slot, pos, tok, slot, IndexKind::WRITE_SLOT, S));
  } else if (rkv_oob >= 0) {
    emit(oob_row(a.tag, slot, pos, tok, slot / a.sources.src[rkv_oob].page_size,
                 static_cast<IndexKind>(code(IndexKind::REAL_KV_SOURCE_0) + rkv_oob), a.sources.src[rkv_oob].rows));
  }
  const int64_t chain = static_cast<int64_t>(chain_hash);
  if (T::input_assert(a)) {
    const int64_t et = T::at(a.exp_tokens, i);
    const int64_t ep = T::at(a.exp_positions, i);
    const int64_t fail = (tok != et ? bits(FailReason::WRITE_TOKEN_MISMATCH) : 0) |
                         (pos != ep ? bits(FailReason::WRITE_POSITION_MISMATCH) : 0);
    if (fail) emit(make_row(a.tag, slot, pos, tok, et, chain, ep, fail));
  }
  if (do_pos && pos != expected_pos)
    emit(make_row(a.tag, slot, pos, tok, tok, chain, expected_pos, bits(FailReason::WRITE_POSITION_MISMATCH)));
}

// Distance, in entries, of the host's write prefetch in write_request (no effect on results).
constexpr int64_t kWritePrefetchAhead = 16;

// A seed's successor hash taken ahead of its request (record_successor(rec)): a launcher computes those
// of a block of requests together, so that their hash chains overlap instead of each waiting behind
// the previous request's. write_request uses `hash` only while the seed still holds `rec` (an earlier
// request of the launch may have written the seed since), so results do not depend on it.
struct SeedHash {
  Record rec;
  uint64_t hash;
};

// The chain of one request (format.md §7.3): the hash each non-skipped entry stores as prev_hash and
// the position the chain-position assert expects of it. Both launchers step it: the CPU entry by
// entry (write_request below), a CUDA block on one thread per tile (cuda_kernels.cu).
struct WriteChain {
  uint64_t running;  // the hash before the next entry, once the pending step is taken
  int64_t last_pos;  // the previous non-skipped entry's position, or the seed's stored position
  bool do_pos;       // the chain-position assert is on: the launch's flag is set and the seed is in range
  bool pending;      // a passed entry not yet folded into `running` (the last entry of a request never is)
  int64_t pending_tok, pending_pos;

  // Request r's chain: reads its seed (emitting the WRITE_SEED OOB row), starts from the seed's
  // successor hash (`ahead`'s when the seed still holds the record it was taken of) and position.
  template <class T = DynamicTraits, class Emit>
  KVC_HD static WriteChain start(const WriteArgs& a, int64_t r, bool chain_on, Emit& emit,
                                 const SeedHash* ahead = nullptr) {
    WriteChain c{0, 0, false, false, 0, 0};
    const int64_t seed = write_seed<T>(a, r, emit);
    if (seed < 0) {
      c.running = a.canary.successor_hash(-1);
      return c;
    }
    const Record s = a.canary.load(seed);
    const bool still = ahead && ahead->rec.prev_hash == s.prev_hash && ahead->rec.token == s.token &&
                       ahead->rec.position == s.position;
    c.running = still ? ahead->hash : record_successor(s);
    c.last_pos = s.position;
    c.do_pos = chain_on;
    return c;
  }
  // The hash the next non-skipped entry stores as prev_hash.
  KVC_HD uint64_t next_hash() {
    if (pending) running = mix3(running, static_cast<uint64_t>(pending_tok), static_cast<uint64_t>(pending_pos));
    pending = false;
    return running;
  }
  KVC_HD static int64_t position_after(int64_t pos) { return add_wrap(pos, 1); }
  KVC_HD int64_t expected_position() const { return position_after(last_pos); }
  // Steps past a non-skipped entry.
  KVC_HD void pass(int64_t tok, int64_t pos) {
    pending = true;
    pending_tok = tok;
    pending_pos = pos;
    last_pos = pos;
  }
};

// Processes request r over flat entries [lo, hi): reads the seed, emits rows in order, stores
// records. Returns the number of counted (non-skipped) entries. With do_store false nothing is
// stored (a count pass); the rows and the return value do not depend on it, nor on `ahead` (the
// seed's hash taken ahead, or null).
template <class T = DynamicTraits, class Emit>
KVC_HD int64_t write_request(const WriteArgs& a, int64_t r, int64_t lo, int64_t hi, Emit& emit,
                             bool do_store = true, const SeedHash* ahead = nullptr) {
  if (hi <= lo) return 0;
  const int64_t S = a.canary.num_slots;
  WriteChain chain = WriteChain::start<T>(a, r, a.chain_assert, emit, ahead);
  int64_t written = 0;
  for (int64_t i = lo; i < hi; ++i) {
#if !defined(__CUDA_ARCH__) && defined(__GNUC__)
    // Host only: a request's slots are scattered pages, so ask for the record kWritePrefetchAhead
    // entries ahead for writing (its cache-line fill then overlaps the serial hash chain).
    if (i + kWritePrefetchAhead < hi) {
      const int64_t next = T::at(a.locs, i + kWritePrefetchAhead);
      if (next >= 0 && next < S) __builtin_prefetch(a.canary.slot_ptr(next), 1);
    }
#endif
    const int64_t slot = T::at(a.locs, i);
    if (slot < 0) continue;
    ++written;
    const uint64_t prev_hash = chain.next_hash();
    const int64_t tok = T::at(a.input_ids, i);
    const int64_t pos = T::at(a.positions, i);
    const int k = write_rkv_oob<T>(a, slot);
    const int64_t rkv = write_takes_fingerprint<T>(a, slot, k) ? static_cast<int64_t>(a.sources.hash(slot)) : 0;
    write_entry_rows<T>(a, i, slot, tok, pos, k, prev_hash, chain.do_pos, chain.expected_position(), emit);
    if (slot < S && do_store) a.canary.store(slot, Record{tok, pos, static_cast<int64_t>(prev_hash), rkv});
    chain.pass(tok, pos);
  }
  return written;
}

// ---- PLAN: one batch row and its entries (format.md §9.3) -------------------------------------------
struct PlanArgs {
  IndexView req_pool_indices, prefix_lens, extend_seq_lens;
  IndexView req_to_token;  // [R, L]; the flat page table [N] when has_row_starts
  int64_t R, L;            // the 2-D table's shape (unused when has_row_starts)
  bool has_row_starts;
  IndexView row_starts;  // [bs]: batch row r reads req_to_token[row_starts[r] + pos]
  int64_t N;             // length of the flat table (has_row_starts only)
  bool has_lut;
  IndexView lut;  // [lut_len]
  int64_t lut_len;
  bool has_pool;
  IndexView pool;  // [Rp, Cp]
  int64_t Rp, Cp;
  IndexView valid_lens;  // [bs]
  int64_t window;        // swa_window_size
  int64_t token_offset;  // kv_token_id_vs_position_offset
  bool report_evicted;   // a live slot the LUT maps to 0 gets -1 (reported), not 0 (skipped)
};

struct PlanRow {
  int64_t rp;
  int64_t window_start;
  int64_t vlen;  // verify entries of this row
  int64_t wlen;  // write entries of this row
  int64_t seed;
};

struct PlanEntry {
  int64_t slot, token, position, prev;
};

// rt(r, rp, pos): the slot of position pos of batch row r, or -1 outside the table. The 2-D table is
// read at [rp, pos]; the flat one (has_row_starts) at row_starts[r] + pos, a wrapping int64 add.
KVC_HD int64_t plan_rt(const PlanArgs& a, int64_t r, int64_t rp, int64_t pos) {
  if (pos < 0) return -1;
  if (a.has_row_starts) {
    const int64_t idx = add_wrap(a.row_starts[r], pos);
    return idx >= 0 && idx < a.N ? a.req_to_token[idx] : -1;
  }
  if (rp < 0 || rp >= a.R || pos >= a.L) return -1;
  return a.req_to_token[rp * a.L + pos];
}

// LUT translation T(x): identity without a LUT, -1 outside [0, lut_len).
KVC_HD int64_t plan_translate(const PlanArgs& a, int64_t x) {
  if (!a.has_lut) return x;
  if (x < 0 || x >= a.lut_len) return -1;
  return a.lut[x];
}

KVC_HD int64_t plan_pool_token(const PlanArgs& a, int64_t r, int64_t rp, int64_t s) {
  if (!a.has_pool) return -1;
  if (s < 0 || s >= a.valid_lens[r] || s >= a.Cp || rp < 0 || rp >= a.Rp) return -1;
  return a.pool[rp * a.Cp + s];
}

KVC_HD PlanRow plan_row(const PlanArgs& a, int64_t r) {
  PlanRow row;
  row.rp = a.req_pool_indices[r];
  const int64_t P = a.prefix_lens[r];
  const int64_t E = a.extend_seq_lens[r];
  const bool live = row.rp != REQ_POOL_IDX_PADDING;
  row.window_start = a.window > 0 ? (sub_wrap(P, a.window) > 0 ? sub_wrap(P, a.window) : 0) : 0;
  const int64_t span = sub_wrap(P, row.window_start);
  row.vlen = live && span > 0 ? span : 0;
  row.wlen = live && E > 0 ? E : 0;
  row.seed = (live && P > 0 && row.wlen > 0) ? plan_translate(a, plan_rt(a, r, row.rp, sub_wrap(P, 1))) : -1;
  return row;
}

KVC_HD PlanEntry plan_entry(const PlanArgs& a, const PlanRow& row, int64_t r, int64_t j) {
  const int64_t pos = add_wrap(row.window_start, j);
  PlanEntry e;
  const int64_t full = plan_rt(a, r, row.rp, pos);
  e.slot = plan_translate(a, full);
  if (a.report_evicted && e.slot == 0 && full > 0) e.slot = -1;  // evicted while attention reads it
  e.prev = pos > 0 ? plan_translate(a, plan_rt(a, r, row.rp, sub_wrap(pos, 1))) : -1;
  e.token = plan_pool_token(a, r, row.rp, add_wrap(pos, a.token_offset));
  e.position = pos;
  return e;
}

// The verify-entry layout of a plan (format.md §9.3): batch row r's entries start at the sum of the
// earlier rows' vlen, saturated at vcap (no entry at or past vcap is filled). plan_start_add is
// associative on [0, vcap], so a launcher may scan it; plan_start_len maps a row into that domain.
KVC_HD int64_t plan_start_len(const PlanRow& row, int64_t vcap) { return row.vlen < vcap ? row.vlen : vcap; }
KVC_HD int64_t plan_start_add(int64_t start, int64_t len, int64_t vcap) {
  const int64_t s = start + len;
  return s < vcap ? s : vcap;
}

// ---- launch views: the buffers of one launch, as both launchers (CPU, CUDA) take them ------------
// The violation log of a verify / write launch (format.md §3.3).
struct LogView {
  uint8_t* ring;  // [capacity, 64]
  int64_t capacity;
  int32_t* write_index;      // [1]
  uint8_t* kernel_counters;  // [num_tags, 8]
  uint8_t* slot_counters;    // [num_tags, 8]
};

// The outputs of a plan launch (format.md §9.2), all int32.
struct PlanOut {
  int32_t *slots, *tokens, *positions, *prevs;  // [vcap]
  int32_t *num_valid, *enable;                  // [1]
  int32_t *offsets;                             // [wcap + 1]
  int32_t *seeds;                               // [wcap]
  int32_t *num_valid_reqs;                      // [1]
};

// Scratch memory of one launch (CUDA: the handler's last result; the CPU launchers take none).
struct ScratchView {
  void* data;
  size_t bytes;
};

// ---- scatter_req_token_ids: one batch row (format.md §9.5) ------------------------------------------
// Number of leading ids of row r to copy (0 = skip the row).
KVC_HD int64_t scatter_row_len(int64_t start, int64_t end, int64_t rp, int64_t Rp, int64_t Cp) {
  const int64_t n0 = sub_wrap(end, start);
  const int64_t n = n0 < Cp ? n0 : Cp;
  if (n <= 0 || rp < 0 || rp >= Rp) return 0;
  return n;
}

}  // namespace kvcanary
