// cpu_launchers.h: the sequential CPU launchers of the four ops, used by the CPU FFI handlers
// (cpu_handlers.cc) and by the native fuzz driver (tests/native). They are plain loops over the
// canary_core.h functions in (request, entry) order, on raw pointers, with no XLA types, so a test
// driver can run them under sanitizers.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "canary_core.h"
#include "cpu_parallel.h"

namespace kvcanary {

// ---- launch specialisation ---------------------------------------------------------------------
// A launch's loop is instantiated per traits (canary_core.h): FixedTraits<wide, plain> when every
// index array of the launch has one width, which fixes the width and, for a plain launch (no token
// check / input assert, no real-KV sources: the HEAD endpoints), those options at compile time;
// DynamicTraits otherwise. Calls run(traits) with the launch's traits.
template <class Run>
void with_traits(bool same_width, bool wide, bool plain, Run&& run) {
  if (!same_width) return run(DynamicTraits{});
  if (plain) {
    if (wide) return run(FixedTraits<true, true>{});
    return run(FixedTraits<false, true>{});
  }
  if (wide) return run(FixedTraits<true, false>{});
  return run(FixedTraits<false, false>{});
}

// ---- VERIFY --------------------------------------------------------------------------------------
// Entries run in blocks: first the predecessors' records of the block are loaded and their successor
// hashes computed in one loop of independent mix3s (successor_hashes), then each entry is checked
// with its predecessor's hash (verify_entry). The block's slot records are asked for one block ahead
// (slots are scattered over pages the hardware prefetcher cannot guess).
constexpr int64_t kHashBlock = 32;

// out[j] = mix3(prev_hash[j], token[j], position[j]) (record_successor of those fields) for a block:
// independent lanes, which the compiler vectorises. On x86-64 with GCC a copy compiled for AVX-512
// (64-bit lane multiplies) runs when the CPU has it, chosen at the first call (not by an ifunc, which
// would run before a sanitizer's runtime is up).
inline __attribute__((always_inline)) void successor_hashes_loop(const uint64_t* prev_hash, const uint64_t* token,
                                                                 const uint64_t* position, uint64_t* out) {
  for (int64_t j = 0; j < kHashBlock; ++j) out[j] = mix3(prev_hash[j], token[j], position[j]);
}

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
__attribute__((target("avx512f,avx512dq"))) inline void successor_hashes_avx512(
    const uint64_t* prev_hash, const uint64_t* token, const uint64_t* position, uint64_t* out) {
  successor_hashes_loop(prev_hash, token, position, out);
}

inline bool cpu_has_avx512dq() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
  }();
  return yes;
}
#endif

inline void successor_hashes(const uint64_t* prev_hash, const uint64_t* token, const uint64_t* position,
                             uint64_t* out) {
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
  if (cpu_has_avx512dq()) return successor_hashes_avx512(prev_hash, token, position, out);
#endif
  successor_hashes_loop(prev_hash, token, position, out);
}

// Entries [begin, end) of a verify launch, rows to `emit`.
template <class T, class Emit>
void verify_entries(const VerifyArgs& a, int64_t begin, int64_t end, Emit& emit) {
  const int64_t S = a.canary.num_slots;
  uint64_t prev_hash[kHashBlock], token[kHashBlock], position[kHashBlock], hash[kHashBlock];
  for (int64_t b = begin; b < end; b += kHashBlock) {
    const int64_t n = std::min(kHashBlock, end - b);
    for (int64_t j = 0; j < kHashBlock; ++j) {
#if defined(__GNUC__)
      if (b + kHashBlock + j < end) {
        const int64_t s = T::at(a.slots, b + kHashBlock + j);
        if (s > 0 && s < S) __builtin_prefetch(a.canary.slot_ptr(s));
      }
#endif
      const int64_t prev = j < n ? T::at(a.prevs, b + j) : 0;
      const Record r = prev > 0 && prev < S ? a.canary.load(prev) : Record{0, 0, 0, 0};
      prev_hash[j] = static_cast<uint64_t>(r.prev_hash);
      token[j] = static_cast<uint64_t>(r.token);
      position[j] = static_cast<uint64_t>(r.position);
    }
    successor_hashes(prev_hash, token, position, hash);
    for (int64_t j = 0; j < n; ++j) verify_entry<T>(a, b + j, emit, &hash[j]);
  }
}

// VERIFY launch (format.md §8.3). `capacity` = V; num_valid / enable are the plan's int32[1] values.
// With several chunks, each chunk first counts its rows (verify_entry with a RowCounter); then only
// the chunks that have rows landing in the ring run again to store them at base + the rows of all
// earlier chunks: the ring is byte-identical to the sequential loop's.
template <class Exec = Sequential>
void verify_launch(const VerifyArgs& a, int64_t capacity, int32_t num_valid, int32_t enable, const LogView& log,
                   const Exec& exec = Exec{}) {
  counter_add(log.kernel_counters, a.tag, 1);
  if (enable == 0) return;
  const int64_t active = verify_active(num_valid, capacity);
  counter_add(log.slot_counters, a.tag, active);
  const int64_t base = log.write_index[0];
  const int64_t chunks = chunk_count(active, exec);
  const bool w = a.slots.is64;
  int64_t rows = 0;
  with_traits(a.tokens.is64 == w && a.positions.is64 == w && a.prevs.is64 == w, w,
              !a.check_token && !a.sources.active(), [&](auto traits) {
    using T = decltype(traits);
    if (chunks == 1) {
      RingAppender emit{log.ring, log.capacity, base};
      verify_entries<T>(a, 0, active, emit);
      rows = emit.count;
      return;
    }
    std::vector<int64_t> chunk_rows(chunks);
    exec.run_chunks(chunks, [&](int64_t k) {
      RowCounter count;
      verify_entries<T>(a, chunk_begin(k, chunks, active), chunk_begin(k + 1, chunks, active), count);
      chunk_rows[k] = count.count;
    });
    for (int64_t k = 0; k < chunks; ++k) {
      const int64_t first = add_wrap(base, rows);
      if (chunk_rows[k] > 0 && first < log.capacity && add_wrap(first, chunk_rows[k]) > 0) {
        RingAppender emit{log.ring, log.capacity, first};
        verify_entries<T>(a, chunk_begin(k, chunks, active), chunk_begin(k + 1, chunks, active), emit);
      }
      rows = add_wrap(rows, chunk_rows[k]);
    }
  });
  if (rows) log.write_index[0] = next_write_index(base, rows);
}

// ---- WRITE ---------------------------------------------------------------------------------------
// The monotone clamp of the offsets (format.md §7.3): o[r] for r in [0, active].
inline std::vector<int64_t> clamped_offsets(IndexView offsets, int64_t active, int64_t num_tokens) {
  std::vector<int64_t> o(active + 1);
  OffsetClamp clamp{INT64_MIN, num_tokens};
  for (int64_t r = 0; r <= active; ++r) o[r] = clamp.next(offsets[r]);
  return o;
}

// True when the requests of a launch are independent chains: no in-range slot is the target of two
// entries, and no (non-empty) request's seed is the target of an entry. Then running them in any
// order stores what the sequential loop stores (format.md §7.4). A duplicate slot inside one request
// also answers false: that only costs speed.
template <class Exec>
bool write_requests_independent(const WriteArgs& a, const std::vector<int64_t>& o, int64_t chunks,
                                const Exec& exec) {
  const int64_t S = a.canary.num_slots;
  const int64_t words = (S + 63) / 64;
  std::unique_ptr<std::atomic<uint64_t>[]> seen(new std::atomic<uint64_t>[words]());
  std::atomic<bool> clash{false};
  const int64_t lo = o.front(), n = o.back() - o.front();
  exec.run_chunks(chunks, [&](int64_t k) {
    for (int64_t i = lo + chunk_begin(k, chunks, n); i < lo + chunk_begin(k + 1, chunks, n); ++i) {
      const int64_t slot = a.locs[i];
      if (slot < 0 || slot >= S) continue;
      const uint64_t bit = uint64_t{1} << (slot & 63);
      if (seen[slot >> 6].fetch_or(bit, std::memory_order_relaxed) & bit) clash.store(true, std::memory_order_relaxed);
    }
  });
  if (clash.load()) return false;
  for (size_t r = 0; r + 1 < o.size(); ++r) {
    if (o[r + 1] <= o[r]) continue;
    const int64_t seed = a.seeds[static_cast<int64_t>(r)];
    if (seed >= 0 && seed < S && (seen[seed >> 6].load(std::memory_order_relaxed) >> (seed & 63) & 1)) return false;
  }
  return true;
}

// Requests [begin, end) in order: body(r, ahead) with `ahead` the successor hash of r's seed taken a
// block of requests early (null for a seed out of range, or when !reads_seed(r)). The seeds of a
// block are independent, so their loads overlap and their hashes are one successor_hashes call; a
// decode launch (one entry per request) is mostly this. The seed record of a request with
// !reads_seed(r) is not loaded: on the parallel path an empty request's seed may be a slot that
// another chunk is storing (write_requests_independent only rules that out for non-empty requests).
template <class T, class ReadsSeed, class Body>
void for_requests_seeded(const WriteArgs& a, int64_t begin, int64_t end, ReadsSeed&& reads_seed, Body&& body) {
  const int64_t S = a.canary.num_slots;
  SeedHash ahead[kHashBlock];
  uint64_t prev_hash[kHashBlock], token[kHashBlock], position[kHashBlock], hash[kHashBlock];
  for (int64_t b = begin; b < end; b += kHashBlock) {
    const int64_t n = std::min(kHashBlock, end - b);
    for (int64_t j = 0; j < kHashBlock; ++j) {
#if defined(__GNUC__)
      if (b + kHashBlock + j < end) {  // the next block's seed record
        const int64_t next = T::at(a.seeds, b + kHashBlock + j);
        if (next >= 0 && next < S) __builtin_prefetch(a.canary.slot_ptr(next));
      }
#endif
      const int64_t seed = j < n && reads_seed(b + j) ? T::at(a.seeds, b + j) : -1;
      const Record r = seed >= 0 && seed < S ? a.canary.load(seed) : Record{0, 0, 0, 0};
      ahead[j].rec = r;
      prev_hash[j] = static_cast<uint64_t>(r.prev_hash);
      token[j] = static_cast<uint64_t>(r.token);
      position[j] = static_cast<uint64_t>(r.position);
    }
    successor_hashes(prev_hash, token, position, hash);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t seed = reads_seed(b + j) ? T::at(a.seeds, b + j) : -1;
      ahead[j].hash = hash[j];
      body(b + j, seed >= 0 && seed < S ? &ahead[j] : nullptr);
    }
  }
}

// WRITE launch (format.md §7.3). `capacity` = C; a.chain_assert is the launch's flag. Requests run in
// order on one thread, unless the launch is large, has several requests and they are independent
// chains (write_requests_independent): then chunks of consecutive requests run on several threads,
// counting each request's rows; the requests that have rows landing in the ring run again without
// storing (a replay reads only the seed, which no request of the launch writes) to store the rows at
// their sequential place. Records and rows are byte-identical to the sequential loop's.
template <class Exec = Sequential>
void write_launch(const WriteArgs& a, IndexView offsets, int64_t capacity, int32_t num_valid_reqs,
                  int64_t num_tokens, const LogView& log, const Exec& exec = Exec{}) {
  counter_add(log.kernel_counters, a.tag, 1);
  const int64_t active = write_active(num_valid_reqs, capacity);
  const int64_t base = log.write_index[0];
  const bool w = a.locs.is64;
  const bool same_width = a.seeds.is64 == w && a.input_ids.is64 == w && a.positions.is64 == w &&
                          (!a.input_assert || (a.exp_tokens.is64 == w && a.exp_positions.is64 == w));
  // Several threads only for a large launch of several independent requests (see above); the
  // sequential path clamps the offsets as it goes, with no allocation.
  std::vector<int64_t> o;
  int64_t chunks = active > 1 ? chunk_count(num_tokens, exec) : 1;
  if (chunks > 1) {
    o = clamped_offsets(offsets, active, num_tokens);
    chunks = chunk_count(o.back() - o.front(), exec);
    if (chunks > 1 && !write_requests_independent(a, o, chunks, exec)) chunks = 1;
  }
  int64_t written = 0, rows = 0;
  with_traits(same_width, w, !a.input_assert && !a.sources.active(), [&](auto traits) {
    using T = decltype(traits);
    if (chunks == 1) {  // requests in order, each over its monotone-clamped offset range
      RingAppender emit{log.ring, log.capacity, base};
      OffsetClamp clamp{INT64_MIN, num_tokens};
      int64_t lo = clamp.next(offsets[0]);
      for_requests_seeded<T>(a, 0, active, [](int64_t) { return true; }, [&](int64_t r, const SeedHash* ahead) {
        const int64_t hi = clamp.next(offsets[r + 1]);
        written += write_request<T>(a, r, lo, hi, emit, /*do_store=*/true, ahead);
        lo = hi;
      });
      rows = emit.count;
      return;
    }
    // Chunk k: the requests whose first entry lies in the k-th slice of the launch's entries.
    const int64_t entries = o.back() - o.front();
    std::vector<int64_t> req_rows(active), req_written(active), first(chunks + 1);
    for (int64_t k = 0; k <= chunks; ++k)
      first[k] = std::lower_bound(o.begin(), o.end() - 1, o.front() + chunk_begin(k, chunks, entries)) - o.begin();
    exec.run_chunks(chunks, [&](int64_t k) {
      const auto non_empty = [&](int64_t r) { return o[r + 1] > o[r]; };
      for_requests_seeded<T>(a, first[k], first[k + 1], non_empty, [&](int64_t r, const SeedHash* ahead) {
        RowCounter count;
        req_written[r] = write_request<T>(a, r, o[r], o[r + 1], count, /*do_store=*/true, ahead);
        req_rows[r] = count.count;
      });
    });
    for (int64_t r = 0; r < active; ++r) {
      const int64_t at = add_wrap(base, rows);
      if (req_rows[r] > 0 && at < log.capacity && add_wrap(at, req_rows[r]) > 0) {
        RingAppender emit{log.ring, log.capacity, at};
        write_request<T>(a, r, o[r], o[r + 1], emit, /*do_store=*/false);
      }
      rows = add_wrap(rows, req_rows[r]);
      written += req_written[r];
    }
  });
  counter_add(log.slot_counters, a.tag, written);
  if (rows) log.write_index[0] = next_write_index(base, rows);
}

// ---- PLAN ----------------------------------------------------------------------------------------
// Entries [begin, end) of the verify arrays: the plan entries below num_entries (rows located through
// `start`, the saturated prefix sums of the rows' entry counts), zeros past it.
inline void plan_fill(const PlanArgs& a, const std::vector<PlanRow>& rows, const std::vector<int64_t>& start,
                      int64_t num_entries, int64_t begin, int64_t end, const PlanOut& out) {
  int64_t f = begin;
  if (f < num_entries) {
    // The row owning entry f: the last row whose first entry is <= f (empty rows share a start).
    int64_t r = std::upper_bound(start.begin(), start.end() - 1, f) - start.begin() - 1;
    int64_t j = f - start[r];
    for (; f < end && f < num_entries; ++f, ++j) {
      while (j >= rows[r].vlen && r + 1 < static_cast<int64_t>(rows.size())) j -= rows[r++].vlen;  // next non-empty row
      const PlanEntry e = plan_entry(a, rows[r], r, j);
      out.slots[f] = static_cast<int32_t>(e.slot);
      out.tokens[f] = static_cast<int32_t>(e.token);
      out.positions[f] = static_cast<int32_t>(e.position);
      out.prevs[f] = static_cast<int32_t>(e.prev);
    }
  }
  if (f < end) {
    const size_t n = static_cast<size_t>(end - f) * sizeof(int32_t);
    std::memset(out.slots + f, 0, n);
    std::memset(out.tokens + f, 0, n);
    std::memset(out.positions + f, 0, n);
    std::memset(out.prevs + f, 0, n);
  }
}

// PLAN launch (format.md §9.3): every output element is written; bs <= wcap is checked in Python. The
// batch rows are planned on one thread; the verify arrays are filled in chunks.
template <class Exec = Sequential>
void plan_launch(const PlanArgs& a, int64_t bs, int64_t vcap, int64_t wcap, const PlanOut& out,
                 const Exec& exec = Exec{}) {
  const int64_t n = bs < wcap ? bs : wcap;
  std::vector<PlanRow> rows(n);
  std::vector<int64_t> start(n + 1);
  std::memset(out.offsets, 0, (wcap + 1) * sizeof(int32_t));
  std::memset(out.seeds, 0, wcap * sizeof(int32_t));
  int64_t total = 0, write_total = 0;
  start[0] = 0;
  for (int64_t r = 0; r < n; ++r) {
    rows[r] = plan_row(a, r);
    total = add_wrap(total, rows[r].vlen);
    write_total = add_wrap(write_total, rows[r].wlen);
    out.offsets[r + 1] = static_cast<int32_t>(write_total);
    out.seeds[r] = static_cast<int32_t>(rows[r].seed);
    start[r + 1] = plan_start_add(start[r], plan_start_len(rows[r], vcap), vcap);
  }
  const bool enable = total <= vcap;
  // Entries [0, total) only: with int64 inputs the wrap-around sum can be < 0 or smaller than the
  // sum of a prefix of rows (format.md §9.3), so the bound is total, not vcap.
  const int64_t num_entries = total < vcap ? total : vcap;
  const int64_t filled = enable ? num_entries : 0;
  const int64_t chunks = chunk_count(vcap, exec);
  exec.run_chunks(chunks, [&](int64_t k) {
    plan_fill(a, rows, start, filled, chunk_begin(k, chunks, vcap), chunk_begin(k + 1, chunks, vcap), out);
  });
  out.num_valid[0] = static_cast<int32_t>(num_entries);
  out.enable[0] = enable ? 1 : 0;
  out.num_valid_reqs[0] = static_cast<int32_t>(bs);
}

// scatter_req_token_ids (format.md §9.5): rows in order, so a later row wins on shared cells.
template <typename T>
void scatter_launch(T* pool, int64_t Rp, int64_t Cp, IndexView flat, int64_t total, IndexView offsets,
                    IndexView req_pool_indices, int64_t bs) {
  for (int64_t r = 0; r < bs; ++r) {
    const int64_t start = offsets[r];
    const int64_t rp = req_pool_indices[r];
    const int64_t n = scatter_row_len(start, offsets[r + 1], rp, Rp, Cp);
    for (int64_t c = 0; c < n; ++c) {
      const int64_t src = add_wrap(start, c);
      if (src >= 0 && src < total) pool[rp * Cp + c] = static_cast<T>(flat[src]);
    }
  }
}

}  // namespace kvcanary
