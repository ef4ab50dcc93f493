/* Native CPU baselines for the jax_kvcanary benchmark (built at bench time: cc -O2 -shared).
 *
 * They work on the same buffers as the canary ops: a canary of 32-byte records (stride bytes per
 * slot, little-endian int64 token, position, prev_hash, real_kv_hash), int32 plan / token arrays.
 *
 *   kvb_read_records   VERIFY memory limit: per entry, load the slot's and the predecessor's 32-byte
 *                      record and fold all 8 words into an accumulator. No hashing, no checks.
 *   kvb_read_records_prefetch   the same loop with a software prefetch of the slot record 16
 *                      entries ahead (what the hardware cannot guess: the slots are scattered pages).
 *   kvb_verify_mix3    VERIFY-equivalent work: the same two record reads, plus the predecessor's
 *                      successor hash (mix3) compared with the slot's prev_hash, the position check
 *                      and the real_kv_hash == 0 check; counts mismatches. No ring, no OOB rows.
 *   kvb_write_chain    WRITE limit: per request, the seed's successor hash, then per entry one
 *                      32-byte record store and one mix3 step (the serial chain). No asserts, no rows.
 *   kvb_write_chain_reps   kvb_write_chain `reps` times in a row (the cost of one small launch without
 *                      the cost of calling C from Python: compared with a custom call's cost inside jit).
 */
#include <stdint.h>
#include <string.h>

#define ANCHOR_HASH 0xDE7FAE23A9A1B716ull

static inline uint64_t sm64(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
static inline uint64_t mix3(uint64_t a, uint64_t b, uint64_t c) {
  uint64_t h = sm64(a);
  h = sm64(h ^ b);
  return sm64(h ^ c);
}
static inline uint64_t ld(const uint8_t* p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline void st(uint8_t* p, uint64_t v) { memcpy(p, &v, 8); }

/* The read loop; `prefetch` is a literal at both call sites, so each gets its own loop. */
static inline uint64_t read_records(const uint8_t* canary, int64_t stride, const int32_t* slots,
                                    const int32_t* prevs, int64_t n, int prefetch) {
  uint64_t acc = 0;
  for (int64_t e = 0; e < n; ++e) {
    if (prefetch && e + 16 < n) __builtin_prefetch(canary + (int64_t)slots[e + 16] * stride);
    const uint8_t* a = canary + (int64_t)slots[e] * stride;
    const int32_t pv = prevs[e] > 0 ? prevs[e] : 0;
    const uint8_t* b = canary + (int64_t)pv * stride;
    acc ^= ld(a) ^ ld(a + 8) ^ ld(a + 16) ^ ld(a + 24);
    acc += ld(b) ^ ld(b + 8) ^ ld(b + 16) ^ ld(b + 24);
  }
  return acc;
}

uint64_t kvb_read_records(const uint8_t* canary, int64_t stride, const int32_t* slots, const int32_t* prevs,
                          int64_t n) {
  return read_records(canary, stride, slots, prevs, n, 0);
}

uint64_t kvb_read_records_prefetch(const uint8_t* canary, int64_t stride, const int32_t* slots,
                                   const int32_t* prevs, int64_t n) {
  return read_records(canary, stride, slots, prevs, n, 1);
}

int64_t kvb_verify_mix3(const uint8_t* canary, int64_t num_slots, int64_t stride, const int32_t* slots,
                        const int32_t* positions, const int32_t* prevs, int64_t n) {
  int64_t bad = 0;
  for (int64_t e = 0; e < n; ++e) {
    const int64_t s = slots[e];
    if (s <= 0 || s >= num_slots) continue;
    const uint8_t* a = canary + s * stride;
    const int64_t p = prevs[e];
    uint64_t expect = (uint64_t)ld(a + 16);
    if (p < 0) {
      expect = ANCHOR_HASH;
    } else if (p > 0 && p < num_slots) {
      const uint8_t* b = canary + p * stride;
      expect = mix3(ld(b + 16), ld(b), ld(b + 8));
    }
    bad += (ld(a + 16) != expect) | ((int64_t)ld(a + 8) != (int64_t)positions[e]) | (ld(a + 24) != 0);
  }
  return bad;
}

int64_t kvb_write_chain(uint8_t* canary, int64_t num_slots, int64_t stride, const int32_t* offsets,
                        const int32_t* seeds, int64_t num_reqs, const int32_t* ids, const int32_t* positions,
                        const int32_t* locs) {
  int64_t written = 0;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t seed = seeds[r];
    uint64_t running = ANCHOR_HASH;
    if (seed >= 0 && seed < num_slots) {
      const uint8_t* b = canary + seed * stride;
      running = mix3(ld(b + 16), ld(b), ld(b + 8));
    }
    for (int64_t i = offsets[r]; i < offsets[r + 1]; ++i) {
      const int64_t s = locs[i];
      if (s < 0) continue;
      const int64_t tok = ids[i], pos = positions[i];
      if (s < num_slots) {
        uint8_t* a = canary + s * stride;
        st(a, (uint64_t)tok);
        st(a + 8, (uint64_t)pos);
        st(a + 16, running);
        st(a + 24, 0);
      }
      running = mix3(running, (uint64_t)tok, (uint64_t)pos);
      ++written;
    }
  }
  return written;
}

int64_t kvb_write_chain_reps(uint8_t* canary, int64_t num_slots, int64_t stride, const int32_t* offsets,
                             const int32_t* seeds, int64_t num_reqs, const int32_t* ids, const int32_t* positions,
                             const int32_t* locs, int64_t reps) {
  int64_t written = 0;
  for (int64_t k = 0; k < reps; ++k)
    written += kvb_write_chain(canary, num_slots, stride, offsets, seeds, num_reqs, ids, positions, locs);
  return written;
}
