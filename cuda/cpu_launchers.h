// cpu_launchers.h: the sequential CPU launchers of the four ops, used by the CPU FFI handlers
// (cpu_handlers.cc) and by the native fuzz driver (tests/native). They are plain loops over the
// canary_core.h functions in (request, entry) order, on raw pointers, with no XLA types, so a test
// driver can run them under sanitizers.
#pragma once

#include <cstdint>
#include <cstring>

#include "canary_core.h"

namespace kvcanary {

// Verify entries are independent and their slots scattered over pages the hardware prefetcher cannot
// guess: the loop asks for the slot record this many entries ahead (one 16-slot page in flight).
constexpr int64_t kVerifyPrefetchAhead = 16;

// The entry loop of a verify launch. kMode fixes, at compile time, what every entry would otherwise
// test at run time: kIndex32 / kIndex64 (all four plan arrays of that width) let the compiler fold
// IndexView's width branch; kPlain adds "no token check and no real-KV sources" (the HEAD endpoints'
// configuration). kGeneric keeps every flag a run-time value. The per-entry logic is verify_entry in
// every mode: the specialisation only turns run-time flags of `a` into constants.
enum VerifyLoopMode { kGeneric, kIndex32, kIndex64, kIndex32Plain, kIndex64Plain };

template <VerifyLoopMode kMode>
void verify_entries(VerifyArgs a, int64_t active, RingAppender& emit) {
  if constexpr (kMode != kGeneric) {
    const bool is64 = kMode == kIndex64 || kMode == kIndex64Plain;
    a.slots.is64 = a.tokens.is64 = a.positions.is64 = a.prevs.is64 = is64;
  }
  if constexpr (kMode == kIndex32Plain || kMode == kIndex64Plain) {
    a.check_token = false;
    a.sources.count = 0;
  }
  for (int64_t e = 0; e < active; ++e) {
#if defined(__GNUC__)
    if (e + kVerifyPrefetchAhead < active) {
      const int64_t s = a.slots[e + kVerifyPrefetchAhead];
      if (s > 0 && s < a.canary.num_slots) __builtin_prefetch(a.canary.slot_ptr(s));
    }
#endif
    verify_entry(a, e, emit);
  }
}

// VERIFY launch (format.md §8.3). `capacity` = V; num_valid / enable are the plan's int32[1] values.
inline void verify_launch(const VerifyArgs& a, int64_t capacity, int32_t num_valid, int32_t enable,
                          const LogView& log) {
  counter_add(log.kernel_counters, a.tag, 1);
  if (enable == 0) return;
  const int64_t active = verify_active(num_valid, capacity);
  counter_add(log.slot_counters, a.tag, active);
  RingAppender emit{log.ring, log.capacity, log.write_index[0]};
  const bool w = a.slots.is64;
  const bool same_width = a.tokens.is64 == w && a.positions.is64 == w && a.prevs.is64 == w;
  const bool plain = !a.check_token && !a.sources.active();
  if (!same_width) verify_entries<kGeneric>(a, active, emit);
  else if (plain) w ? verify_entries<kIndex64Plain>(a, active, emit) : verify_entries<kIndex32Plain>(a, active, emit);
  else w ? verify_entries<kIndex64>(a, active, emit) : verify_entries<kIndex32>(a, active, emit);
  if (emit.count) log.write_index[0] = next_write_index(emit.base, emit.count);
}

// WRITE launch (format.md §7.3): requests in order, each over its monotone-clamped offset range.
inline void write_launch(const WriteArgs& a, IndexView offsets, int64_t capacity, int32_t num_valid_reqs,
                         int64_t num_tokens, const LogView& log) {
  counter_add(log.kernel_counters, a.tag, 1);
  const int64_t active = write_active(num_valid_reqs, capacity);
  RingAppender emit{log.ring, log.capacity, log.write_index[0]};
  int64_t running_max = offsets[0];
  int64_t lo = clamp_offset(running_max, num_tokens);
  int64_t written = 0;
  for (int64_t r = 0; r < active; ++r) {
    const int64_t next = offsets[r + 1];
    if (next > running_max) running_max = next;
    const int64_t hi = clamp_offset(running_max, num_tokens);
    written += write_request(a, r, lo, hi, emit);
    lo = hi;
  }
  counter_add(log.slot_counters, a.tag, written);
  if (emit.count) log.write_index[0] = next_write_index(emit.base, emit.count);
}

// PLAN launch (format.md §9.3): every output element is written; bs <= wcap is checked in Python.
inline void plan_launch(const PlanArgs& a, int64_t bs, int64_t vcap, int64_t wcap, const PlanOut& out) {
  std::memset(out.slots, 0, vcap * sizeof(int32_t));
  std::memset(out.tokens, 0, vcap * sizeof(int32_t));
  std::memset(out.positions, 0, vcap * sizeof(int32_t));
  std::memset(out.prevs, 0, vcap * sizeof(int32_t));
  std::memset(out.offsets, 0, (wcap + 1) * sizeof(int32_t));
  std::memset(out.seeds, 0, wcap * sizeof(int32_t));
  int64_t total = 0;
  int64_t write_total = 0;
  for (int64_t r = 0; r < bs && r < wcap; ++r) {
    const PlanRow row = plan_row(a, r);
    total = add_wrap(total, row.vlen);
    write_total = add_wrap(write_total, row.wlen);
    out.offsets[r + 1] = static_cast<int32_t>(write_total);
    out.seeds[r] = static_cast<int32_t>(row.seed);
  }
  const bool enable = total <= vcap;
  // Entries [0, total) only: with int64 inputs the wrap-around sum can be < 0 or smaller than the
  // sum of a prefix of rows (format.md §9.3), so the bound is total, not vcap.
  const int64_t num_entries = total < vcap ? total : vcap;
  if (enable) {
    int64_t flat = 0;
    for (int64_t r = 0; r < bs && flat < num_entries; ++r) {
      const PlanRow row = plan_row(a, r);
      for (int64_t j = 0; j < row.vlen && flat < num_entries; ++j, ++flat) {
        const PlanEntry e = plan_entry(a, row, r, j);
        out.slots[flat] = static_cast<int32_t>(e.slot);
        out.tokens[flat] = static_cast<int32_t>(e.token);
        out.positions[flat] = static_cast<int32_t>(e.position);
        out.prevs[flat] = static_cast<int32_t>(e.prev);
      }
    }
  }
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
