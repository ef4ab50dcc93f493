// cuda_kernels.cu: the CUDA launchers of the four ops (declared in cuda_kernels.h). Every
// per-entry / per-request / per-row computation is a canary_core.h function; this file holds only
// launch geometry, block-level scans, the write conflict detector and the deterministic ring append.
// No XLA types: the CUDA FFI handlers (cuda_handlers.cc) call the *_enqueue functions, and so does
// the CPU emulation harness (tests/cuda_emu), which compiles this file with g++.
//
// Semantics are those of the sequential CPU launchers (cpu_launchers.h), byte for byte:
//   * ring rows in (request, entry) order (format.md §5.2): count pass -> scan -> write pass at base+prefix;
//   * write launches behave as if requests ran one after another (format.md §7.4): a conflict detector
//     (hash set of the target slots) picks, on the device, either the parallel fast path or a
//     single-block path that processes the requests in order;
//   * no host sync, no host read of device data, no device allocation: scratch is handed in (the FFI
//     handler's last result, which XLA allocates with the call's other buffers, so it stays valid when
//     the call is recorded into a command buffer and replayed), sized by *_scratch_bytes() below.
#include "cuda_kernels.h"

#include <cuda_runtime.h>

#include <cstdint>

#include "canary_core.h"

#include "cuda_geometry.h"

// Kernel launch; the CPU emulation harness (tests/cuda_emu/cuda_runtime.h) defines its own.
#ifndef KVC_LAUNCH
#define KVC_LAUNCH(kernel, grid, block, stream, ...) kernel<<<(grid), (block), 0, (stream)>>>(__VA_ARGS__)
#endif

namespace kvcanary {
namespace {

// ---- small device helpers ----------------------------------------------------------------------
__device__ __forceinline__ int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }

struct OpSum {  // wrap-around int64 addition (associative and commutative)
  __device__ __forceinline__ int64_t operator()(int64_t a, int64_t b) const { return add_wrap(a, b); }
};
struct OpMax {
  __device__ __forceinline__ int64_t operator()(int64_t a, int64_t b) const { return a > b ? a : b; }
};
struct OpPlanStart {  // plan_start_add (canary_core.h): associative on [0, vcap]
  int64_t vcap;
  __device__ __forceinline__ int64_t operator()(int64_t a, int64_t b) const { return plan_start_add(a, b, vcap); }
};

// Block-wide exclusive scan of one int64 per thread (thread order = element order). Every thread of
// the block must call it (it contains __syncthreads). Returns the exclusive prefix; *total gets the
// reduction of the whole block. `smem` holds BD/32 values and may be reused by the next call.
template <int BD, class Op>
__device__ __forceinline__ int64_t block_scan_excl(int64_t v, Op op, int64_t identity, int64_t* total,
                                                   int64_t* smem) {
  static_assert(BD % 32 == 0 && BD >= 32 && BD <= 1024, "block size");
  constexpr int kWarps = BD / 32;
  constexpr unsigned kFull = 0xffffffffu;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  int64_t x = v;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int64_t y = __shfl_up_sync(kFull, x, d);
    if (lane >= d) x = op(y, x);
  }
  int64_t excl = __shfl_up_sync(kFull, x, 1);
  if (lane == 0) excl = identity;
  __syncthreads();  // earlier readers of smem are done
  if (lane == 31) smem[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int64_t w = lane < kWarps ? smem[lane] : identity;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int64_t y = __shfl_up_sync(kFull, w, d);
      if (lane >= d) w = op(y, w);
    }
    if (lane < kWarps) smem[lane] = w;  // inclusive prefix of the warp totals
  }
  __syncthreads();
  const int64_t before = warp > 0 ? smem[warp - 1] : identity;
  *total = smem[kWarps - 1];
  return op(before, excl);
}

// ================================================================================================
// VERIFY (format.md §8.3): one thread per entry, each block owning a contiguous chunk of entries.
//   verify_count_kernel: rows per block (verify_entry with a RowCounter; hashes evaluated).
//   verify_emit_kernel:  block 0 updates the counters and write_index; every block with rows
//                        re-evaluates its chunk tile by tile, scans the per-entry counts and emits
//                        with a RingAppender based at write_index + rows of all earlier entries.
// ================================================================================================
constexpr int kVerifyThreads = KVC_VERIFY_THREADS;
constexpr int64_t kVerifyMaxBlocks = KVC_VERIFY_MAX_BLOCKS;

struct VerifyLaunch {
  VerifyArgs a;
  int64_t capacity;  // V
  const int32_t* num_valid;
  const int32_t* enable;
  LogView log;
  int64_t chunk;        // entries per block, a multiple of kVerifyThreads
  int64_t* block_rows;  // scratch [gridDim.x]
  int64_t* base;        // scratch [1]: write_index at launch start
};

__device__ __forceinline__ int64_t verify_active_dev(const VerifyLaunch& L) {
  return L.enable[0] == 0 ? 0 : verify_active(L.num_valid[0], L.capacity);
}

__global__ void __launch_bounds__(kVerifyThreads) verify_count_kernel(const __grid_constant__ VerifyLaunch L) {
  __shared__ int64_t smem[kVerifyThreads / 32];
  const int64_t active = verify_active_dev(L);
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * L.chunk;
  const int64_t end = imin(begin + L.chunk, active);
  int64_t n = 0;
  for (int64_t e = begin + threadIdx.x; e < end; e += kVerifyThreads) {
    RowCounter c;
    verify_entry(L.a, e, c);
    n += c.count;
  }
  int64_t total;
  block_scan_excl<kVerifyThreads>(n, OpSum{}, 0, &total, smem);
  if (threadIdx.x == 0) {
    L.block_rows[blockIdx.x] = total;
    if (blockIdx.x == 0) *L.base = L.log.write_index[0];
  }
}

__global__ void __launch_bounds__(kVerifyThreads) verify_emit_kernel(const __grid_constant__ VerifyLaunch L) {
  __shared__ int64_t smem[kVerifyThreads / 32];
  const int64_t b = blockIdx.x;
  const int64_t mine = L.block_rows[b];
  if (mine == 0 && b != 0) return;  // the common case: no rows in this chunk
  // Rows of all earlier blocks (block 0: of all blocks, the launch total).
  const int64_t upto = b == 0 ? static_cast<int64_t>(gridDim.x) : b;
  int64_t part = 0;
  for (int64_t j = threadIdx.x; j < upto; j += kVerifyThreads) part = add_wrap(part, L.block_rows[j]);
  int64_t sum;
  block_scan_excl<kVerifyThreads>(part, OpSum{}, 0, &sum, smem);
  const int64_t base = *L.base;
  if (b == 0 && threadIdx.x == 0) {
    counter_add(L.log.kernel_counters, L.a.tag, 1);
    if (L.enable[0] != 0) counter_add(L.log.slot_counters, L.a.tag, verify_active_dev(L));
    if (sum > 0) L.log.write_index[0] = next_write_index(base, sum);
  }
  if (mine == 0) return;
  const int64_t active = verify_active_dev(L);
  const int64_t begin = b * L.chunk;
  const int64_t end = imin(begin + L.chunk, active);
  int64_t running = b == 0 ? 0 : sum;
  for (int64_t t0 = begin; t0 < end; t0 += kVerifyThreads) {  // uniform bounds: every thread scans
    const int64_t e = t0 + threadIdx.x;
    int64_t n = 0;
    if (e < end) {
      RowCounter c;
      verify_entry(L.a, e, c);
      n = c.count;
    }
    int64_t tile;
    const int64_t excl = block_scan_excl<kVerifyThreads>(n, OpSum{}, 0, &tile, smem);
    if (n > 0) {
      RingAppender out{L.log.ring, L.log.capacity, add_wrap(base, add_wrap(running, excl))};
      verify_entry(L.a, e, out);
    }
    running = add_wrap(running, tile);
  }
}

// ================================================================================================
// WRITE (format.md §7.3, §7.4). Five stream operations, all always issued (graph-safe, no host sync):
//   memset     the conflict hash set to EMPTY;
//   prep       (1 block)  monotone-clamped offsets o[0..active];
//   count      (block per request) rows per request (write_seed / write_entry_rows with a
//              RowCounter: the counts never depend on hashes), non-skipped entries per request, and
//              every in-range target slot inserted into the hash set; a slot seen twice sets
//              `conflict`;
//   scan       (1 block)  row_start[r] = exclusive scan of the row counts; a non-empty request whose
//              seed slot is in the hash set sets `conflict`; counters; write_index when no conflict;
//   main       no conflict: block per request (parallel), rows at base + row_start[r].
//              conflict:    block 0 runs every request in order, each request block-parallel inside,
//                           rows appended at a running offset, then write_index; the others exit.
// Without a conflict every in-range slot is stored by exactly one entry of the launch and no seed is
// stored in it, so the parallel path equals the sequential order; with one, the in-order path runs.
// Inside a request: loads, fingerprints (one thread per (entry, source)), row counts, row emission
// and stores are spread over the block; only the mix3 chain step runs on one thread.
// ================================================================================================
constexpr int kWriteThreads = KVC_WRITE_THREADS;
constexpr int kOneBlockThreads = KVC_ONE_BLOCK_THREADS;
constexpr int64_t kMaxGridBlocks = KVC_MAX_GRID_BLOCKS;
constexpr unsigned long long kEmptyKey = ~0ull;

struct WriteCtrl {
  unsigned int conflict;
  unsigned int pad;
  int64_t base;  // write_index at launch start
};

struct WriteLaunch {
  WriteArgs a;  // a.chain_assert is unused here: the flag is a device value (chain_flag)
  const int32_t* chain_flag;
  IndexView offsets;  // [C + 1]
  int64_t C, N;
  const int32_t* num_valid_reqs;
  LogView log;
  // scratch
  int64_t* o;            // [C + 1]
  int64_t* req_rows;     // [C]
  int64_t* req_written;  // [C]
  int64_t* row_start;    // [C]
  unsigned long long* table;  // [table_mask + 1], EMPTY = kEmptyKey
  uint64_t table_mask;
  WriteCtrl* ctrl;
};

__device__ __forceinline__ int64_t write_active_dev(const WriteLaunch& L) {
  return write_active(L.num_valid_reqs[0], L.C);
}

// Hash set of slots (0 <= key < 2^63, so never kEmptyKey). Size >= 2 x the number of inserts, so a
// probe always finds an empty cell. Returns true when the key was already present.
__device__ __forceinline__ bool table_insert(const WriteLaunch& L, uint64_t key) {
  uint64_t h = splitmix64(key) & L.table_mask;
  while (true) {
    const unsigned long long prev = atomicCAS(&L.table[h], kEmptyKey, static_cast<unsigned long long>(key));
    if (prev == kEmptyKey) return false;
    if (prev == key) return true;
    h = (h + 1) & L.table_mask;
  }
}
__device__ __forceinline__ bool table_contains(const WriteLaunch& L, uint64_t key) {
  uint64_t h = splitmix64(key) & L.table_mask;
  while (true) {
    const unsigned long long v = L.table[h];
    if (v == key) return true;
    if (v == kEmptyKey) return false;
    h = (h + 1) & L.table_mask;
  }
}

__global__ void __launch_bounds__(kOneBlockThreads) write_prep_kernel(const __grid_constant__ WriteLaunch L) {
  __shared__ int64_t smem[kOneBlockThreads / 32];
  const int64_t active = write_active_dev(L);
  if (threadIdx.x == 0) L.ctrl->conflict = 0;
  // o[k] = clamp(max(offsets[0..k]), 0, N) for k = 0..active (prefix-max scan, tile by tile).
  int64_t carry = INT64_MIN;
  for (int64_t k0 = 0; k0 <= active; k0 += kOneBlockThreads) {
    const int64_t k = k0 + threadIdx.x;
    const int64_t v = k <= active ? L.offsets[k] : INT64_MIN;
    int64_t tile_max;
    const int64_t excl = block_scan_excl<kOneBlockThreads>(v, OpMax{}, INT64_MIN, &tile_max, smem);
    if (k <= active) L.o[k] = clamp_offset(imax(carry, imax(excl, v)), L.N);
    carry = imax(carry, tile_max);
  }
}

struct WriteTile {
  int64_t slot[kWriteThreads];
  int64_t tok[kWriteThreads];
  int64_t pos[kWriteThreads];
  uint64_t prev_hash[kWriteThreads];
  uint64_t fold[kWriteThreads][MAX_REAL_KV_SOURCES];
  unsigned char fp[kWriteThreads];
  int64_t scan[kWriteThreads / 32];
  WriteChain chain;  // the request's chain (canary_core.h), stepped by thread 0
  int64_t rows;      // rows of this request so far (the WRITE_SEED row included)
  int64_t written;   // non-skipped entries so far
};

// One request, block-cooperative. kEmit = false: count pass (rows, non-skipped entries, hash-set
// inserts; nothing stored, no hash computed). kEmit = true: rows go to base + row_start + ..., records
// are stored. `dedup`: within a tile only the last entry of a duplicated slot stores (the in-order
// path; the parallel path has no duplicates). Every thread must call it with the same arguments.
// Returns the request's rows and non-skipped entries (uniform over the block).
struct RequestTotals {
  int64_t rows, written;
};
template <bool kEmit>
__device__ RequestTotals write_request_block(const WriteLaunch& L, int64_t r, int64_t row_start, bool chain_on,
                                             bool dedup, WriteTile& sh) {
  const WriteArgs& a = L.a;
  const int t = threadIdx.x;
  const int64_t lo = L.o[r];
  const int64_t hi = L.o[r + 1];
  if (hi <= lo) return RequestTotals{0, 0};  // empty request: no seed read, no rows
  const int64_t S = a.canary.num_slots;
  const int64_t base = kEmit ? L.ctrl->base : 0;
  __syncthreads();  // the previous request's readers of sh are done
  if (t == 0) {
    if (kEmit) {
      RingAppender out{L.log.ring, L.log.capacity, add_wrap(base, row_start)};
      sh.chain = WriteChain::start(a, r, chain_on, out);
      sh.rows = out.count;
    } else {
      RowCounter c;
      sh.chain = WriteChain::start(a, r, chain_on, c);
      sh.rows = c.count;
    }
    sh.written = 0;
  }
  __syncthreads();
  const bool do_pos = sh.chain.do_pos;
  const int ns = a.sources.active() ? a.sources.count : 0;
  for (int64_t t0 = lo; t0 < hi; t0 += kWriteThreads) {  // uniform bounds
    const int n_in = static_cast<int>(imin(kWriteThreads, hi - t0));
    const int64_t i = t0 + t;
    const int64_t slot = t < n_in ? a.locs[i] : -1;
    const bool live = slot >= 0;  // non-skipped
    const int64_t tok = live ? a.input_ids[i] : 0;
    const int64_t pos = live ? a.positions[i] : 0;
    const int k_oob = live ? write_rkv_oob(a, slot) : -1;
    const bool fp = live && write_takes_fingerprint(a, slot, k_oob);
    sh.slot[t] = slot;
    sh.tok[t] = tok;
    sh.pos[t] = pos;
    sh.fp[t] = fp ? 1 : 0;
    // Previous non-skipped entry of the tile (max-scan of live thread indices); the scan's barriers
    // also publish sh.* of this tile.
    int64_t last_live;
    const int64_t prev_t = block_scan_excl<kWriteThreads>(live ? t : -1, OpMax{}, -1, &last_live, sh.scan);
    const int64_t expected =
        prev_t >= 0 ? WriteChain::position_after(sh.pos[prev_t]) : sh.chain.expected_position();
    int64_t n = 0;
    if (live) {
      RowCounter c;
      write_entry_rows(a, i, slot, tok, pos, k_oob, 0, do_pos, expected, c);
      n = c.count;
    }
    int64_t tile_rows;
    const int64_t excl = block_scan_excl<kWriteThreads>(n, OpSum{}, 0, &tile_rows, sh.scan);
    const int tile_live = __syncthreads_count(live);
    if (!kEmit) {
      if (live && slot < S && table_insert(L, static_cast<uint64_t>(slot))) atomicOr(&L.ctrl->conflict, 1u);
    } else {
      if (ns > 0) {  // fingerprints: one work item per (entry, source), spread over the block
        for (int item = t; item < n_in * ns; item += kWriteThreads) {
          const int e = item / ns;
          const int k = item - e * ns;
          if (sh.fp[e]) sh.fold[e][k] = a.sources.fold_one(k, sh.slot[e]);
        }
        __syncthreads();
      }
      int64_t rkv = 0;
      if (fp) {
        uint64_t acc = 0;
        for (int k = 0; k < ns; ++k) acc = RealKvSources::combine(acc, sh.fold[t][k]);
        rkv = static_cast<int64_t>(acc);
      }
      if (t == 0) {  // the serial part: the chain over the tile's non-skipped entries
        for (int e = 0; e < n_in; ++e) {
          if (sh.slot[e] < 0) continue;
          sh.prev_hash[e] = sh.chain.next_hash();
          sh.chain.pass(sh.tok[e], sh.pos[e]);
        }
      }
      __syncthreads();
      const uint64_t chain = live ? sh.prev_hash[t] : 0;
      if (n > 0) {
        RingAppender out{L.log.ring, L.log.capacity, add_wrap(base, add_wrap(row_start, add_wrap(sh.rows, excl)))};
        write_entry_rows(a, i, slot, tok, pos, k_oob, chain, do_pos, expected, out);
      }
      if (live && slot < S) {
        bool store = true;
        if (dedup) {
          for (int e = t + 1; e < n_in; ++e) {
            if (sh.slot[e] == slot) {
              store = false;  // a later entry of this tile writes the slot: it wins
              break;
            }
          }
        }
        if (store) a.canary.store(slot, Record{tok, pos, static_cast<int64_t>(chain), rkv});
      }
    }
    __syncthreads();  // all reads of sh for this tile are done
    if (t == 0) {
      sh.rows = add_wrap(sh.rows, tile_rows);
      sh.written += tile_live;
      // The count pass steps the chain only past the tile's last entry: it reads positions, no hash.
      if (!kEmit && last_live >= 0) sh.chain.pass(sh.tok[last_live], sh.pos[last_live]);
    }
    __syncthreads();  // with dedup, also orders this tile's stores before the next tile's
  }
  return RequestTotals{sh.rows, sh.written};
}

__global__ void __launch_bounds__(kWriteThreads) write_count_kernel(const __grid_constant__ WriteLaunch L) {
  __shared__ WriteTile sh;
  const int64_t active = write_active_dev(L);
  const bool chain_on = L.chain_flag[0] != 0;
  for (int64_t r = blockIdx.x; r < active; r += gridDim.x) {
    const RequestTotals n = write_request_block<false>(L, r, 0, chain_on, false, sh);
    if (threadIdx.x == 0) {
      L.req_rows[r] = n.rows;
      L.req_written[r] = n.written;
    }
  }
}

__global__ void __launch_bounds__(kOneBlockThreads) write_scan_kernel(const __grid_constant__ WriteLaunch L) {
  __shared__ int64_t smem[kOneBlockThreads / 32];
  const WriteArgs& a = L.a;
  const int64_t S = a.canary.num_slots;
  const int64_t active = write_active_dev(L);
  int64_t rows_carry = 0;
  int64_t written = 0;
  int seed_conflict = 0;
  for (int64_t r0 = 0; r0 < active; r0 += kOneBlockThreads) {
    const int64_t r = r0 + threadIdx.x;
    const bool in = r < active;
    int64_t tile_rows, tile_written;
    const int64_t excl = block_scan_excl<kOneBlockThreads>(in ? L.req_rows[r] : 0, OpSum{}, 0, &tile_rows, smem);
    block_scan_excl<kOneBlockThreads>(in ? L.req_written[r] : 0, OpSum{}, 0, &tile_written, smem);
    if (in) {
      L.row_start[r] = add_wrap(rows_carry, excl);
      if (L.o[r + 1] > L.o[r]) {  // a request that reads its seed
        const int64_t seed = a.seeds[r];
        if (seed >= 0 && seed < S && table_contains(L, static_cast<uint64_t>(seed))) seed_conflict = 1;
      }
    }
    rows_carry = add_wrap(rows_carry, tile_rows);
    written = add_wrap(written, tile_written);
  }
  const int any_seed_conflict = __syncthreads_or(seed_conflict);
  if (threadIdx.x == 0) {
    counter_add(L.log.kernel_counters, a.tag, 1);
    counter_add(L.log.slot_counters, a.tag, written);
    const int64_t base = L.log.write_index[0];
    L.ctrl->base = base;
    const unsigned int conflict = L.ctrl->conflict | (any_seed_conflict ? 1u : 0u);
    L.ctrl->conflict = conflict;
    if (!conflict && rows_carry > 0) L.log.write_index[0] = next_write_index(base, rows_carry);
  }
}

__global__ void __launch_bounds__(kWriteThreads) write_main_kernel(const __grid_constant__ WriteLaunch L) {
  __shared__ WriteTile sh;
  const int64_t active = write_active_dev(L);
  const bool chain_on = L.chain_flag[0] != 0;
  // No conflict: requests spread over the blocks, rows at row_start[r].
  // Conflict (in-order path): block 0 runs request after request, so each request sees the stores of
  // the earlier ones (seed hash, seed position, duplicate slots) exactly as in the sequential loop,
  // and appends its rows after theirs; the other blocks exit.
  const bool in_order = L.ctrl->conflict != 0;
  if (in_order && blockIdx.x != 0) return;
  const int64_t first = in_order ? 0 : blockIdx.x;
  const int64_t step = in_order ? 1 : gridDim.x;
  int64_t rows = 0;
  for (int64_t r = first; r < active; r += step) {
    const int64_t row_start = in_order ? rows : L.row_start[r];
    rows = add_wrap(rows, write_request_block<true>(L, r, row_start, chain_on, in_order, sh).rows);
  }
  if (in_order && threadIdx.x == 0 && rows > 0) L.log.write_index[0] = next_write_index(L.ctrl->base, rows);
}

// ================================================================================================
// PLAN (format.md §9.3): two launches.
//   plan_rows_kernel (1 block): plan_row per batch row; wrap-scan of wlen -> offsets; seeds; the
//       wrap sum of vlen -> num_valid / enable; a saturating scan of vlen -> vstart (entry layout).
//   plan_entries_kernel (grid): entry f -> owning row by binary search on vstart -> plan_entry; the
//       zero tails of the write plan.
// ================================================================================================
constexpr int kPlanThreads = KVC_PLAN_THREADS;

struct PlanLaunch {
  PlanArgs a;
  int64_t bs, vcap, wcap;
  PlanOut out;
  PlanRow* rows;    // scratch [max(bs, 1)]
  int64_t* vstart;  // scratch [bs + 1]: the rows' verify-entry starts (plan_start_add)
  int64_t* filled;  // scratch [1]: entries to fill (0 when disabled)
};

__global__ void __launch_bounds__(kOneBlockThreads) plan_rows_kernel(const __grid_constant__ PlanLaunch L) {
  __shared__ int64_t smem[kOneBlockThreads / 32];
  int64_t carry_w = 0, carry_total = 0, carry_start = 0;
  const OpPlanStart sat{L.vcap};
  for (int64_t r0 = 0; r0 < L.bs; r0 += kOneBlockThreads) {
    const int64_t r = r0 + threadIdx.x;
    const bool in = r < L.bs;
    PlanRow row{};
    if (in) {
      row = plan_row(L.a, r);
      L.rows[r] = row;
      L.out.seeds[r] = static_cast<int32_t>(row.seed);
    }
    const int64_t vlen = in ? row.vlen : 0;
    const int64_t wlen = in ? row.wlen : 0;
    int64_t tile_w, tile_total, tile_start;
    const int64_t ew = block_scan_excl<kOneBlockThreads>(wlen, OpSum{}, 0, &tile_w, smem);
    block_scan_excl<kOneBlockThreads>(vlen, OpSum{}, 0, &tile_total, smem);
    const int64_t es = block_scan_excl<kOneBlockThreads>(in ? plan_start_len(row, L.vcap) : 0, sat, 0, &tile_start,
                                                         smem);
    if (in) {
      L.out.offsets[r + 1] = static_cast<int32_t>(add_wrap(carry_w, add_wrap(ew, wlen)));
      L.vstart[r] = sat(carry_start, es);
    }
    carry_w = add_wrap(carry_w, tile_w);
    carry_total = add_wrap(carry_total, tile_total);
    carry_start = sat(carry_start, tile_start);
  }
  if (threadIdx.x == 0) {
    const int64_t total = carry_total;
    const bool enable = total <= L.vcap;
    L.vstart[L.bs] = carry_start;
    // Entries [0, total) are filled when enabled (format.md §9.3); total <= vcap then.
    *L.filled = enable ? imax(total, 0) : 0;
    L.out.offsets[0] = 0;
    L.out.num_valid[0] = static_cast<int32_t>(total < L.vcap ? total : L.vcap);
    L.out.enable[0] = enable ? 1 : 0;
    L.out.num_valid_reqs[0] = static_cast<int32_t>(L.bs);
  }
}

__global__ void __launch_bounds__(kPlanThreads) plan_entries_kernel(const __grid_constant__ PlanLaunch L) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kPlanThreads;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kPlanThreads + threadIdx.x;
  const int64_t filled = *L.filled;
  for (int64_t f = first; f < L.vcap; f += stride) {
    int32_t slot = 0, tok = 0, pos = 0, prev = 0;
    if (f < filled) {
      // Owning row: the largest r in [0, bs) with vstart[r] <= f (empty rows share a start; the last
      // of them is the one whose entries begin there). f < filled <= vstart[bs] gives f < vstart[r+1].
      int64_t lo = 0, hi = L.bs - 1;
      while (lo < hi) {
        const int64_t mid = lo + (hi - lo + 1) / 2;
        if (L.vstart[mid] <= f) lo = mid; else hi = mid - 1;
      }
      const PlanEntry e = plan_entry(L.a, L.rows[lo], lo, f - L.vstart[lo]);
      slot = static_cast<int32_t>(e.slot);
      tok = static_cast<int32_t>(e.token);
      pos = static_cast<int32_t>(e.position);
      prev = static_cast<int32_t>(e.prev);
    }
    L.out.slots[f] = slot;
    L.out.tokens[f] = tok;
    L.out.positions[f] = pos;
    L.out.prevs[f] = prev;
  }
  for (int64_t k = first; k <= L.wcap; k += stride) {  // zero tails of the write plan
    if (k > L.bs) L.out.offsets[k] = 0;
    if (k >= L.bs && k < L.wcap) L.out.seeds[k] = 0;
  }
}

// ================================================================================================
// scatter_req_token_ids (format.md §9.5): one thread per pool column, looping over the batch rows in
// order (staged through shared memory), so a later row wins on every cell without races.
// ================================================================================================
constexpr int kScatterThreads = KVC_SCATTER_THREADS;

template <typename T>
__global__ void __launch_bounds__(kScatterThreads)
    scatter_kernel(T* pool, int64_t Rp, int64_t Cp, IndexView flat, int64_t total, IndexView offsets,
                   IndexView rpi, int64_t bs) {
  __shared__ int64_t s_start[kScatterThreads], s_n[kScatterThreads], s_rp[kScatterThreads];
  for (int64_t c0 = static_cast<int64_t>(blockIdx.x) * kScatterThreads; c0 < Cp;
       c0 += static_cast<int64_t>(gridDim.x) * kScatterThreads) {  // uniform bounds
    const int64_t c = c0 + threadIdx.x;
    for (int64_t r0 = 0; r0 < bs; r0 += kScatterThreads) {
      const int64_t r = r0 + threadIdx.x;
      __syncthreads();  // the previous stage's readers are done
      if (r < bs) {
        const int64_t start = offsets[r];
        const int64_t rp = rpi[r];
        s_start[threadIdx.x] = start;
        s_rp[threadIdx.x] = rp;
        s_n[threadIdx.x] = scatter_row_len(start, offsets[r + 1], rp, Rp, Cp);
      }
      __syncthreads();
      const int nr = static_cast<int>(imin(kScatterThreads, bs - r0));
      for (int k = 0; k < nr; ++k) {
        if (c >= s_n[k]) continue;  // s_n <= Cp, so c < Cp here
        const int64_t src = add_wrap(s_start[k], c);
        if (src >= 0 && src < total) pool[s_rp[k] * Cp + c] = static_cast<T>(flat[src]);
      }
    }
  }
}

// ================================================================================================
// Host side. The *_layout functions size and place the scratch of one launch; the *_enqueue functions
// carve it and issue the stream operations. Nothing on the host reads device data.
// ================================================================================================
int64_t blocks_for(int64_t n, int64_t per_block, int64_t max_blocks) {
  int64_t b = (n + per_block - 1) / per_block;
  if (b < 1) b = 1;
  return b < max_blocks ? b : max_blocks;
}

// One scratch allocation carved into 256-byte aligned pieces.
class ScratchCarver {
 public:
  size_t add(size_t bytes) {
    const size_t at = total_;
    total_ += (bytes + 255) / 256 * 256;
    return at;
  }
  size_t total() const { return total_ > 0 ? total_ : 256; }

 private:
  size_t total_ = 0;
};

template <typename T>
T* carve_at(const ScratchView& s, size_t offset) {
  return reinterpret_cast<T*>(static_cast<char*>(s.data) + offset);
}

// VERIFY geometry and scratch: `chunk` entries per block over `grid` blocks; per-block row counts and
// the launch-start write_index.
struct VerifyLayout {
  int64_t chunk, grid;
  size_t off_rows, off_base, bytes;
};
VerifyLayout verify_layout(int64_t capacity) {
  VerifyLayout v{};
  const int64_t grid0 = blocks_for(capacity, kVerifyThreads, kVerifyMaxBlocks);
  const int64_t per_block = (capacity + grid0 - 1) / grid0;
  v.chunk = (per_block + kVerifyThreads - 1) / kVerifyThreads * kVerifyThreads;
  if (v.chunk < kVerifyThreads) v.chunk = kVerifyThreads;
  v.grid = blocks_for(capacity, v.chunk, kVerifyMaxBlocks);
  ScratchCarver carve;
  v.off_rows = carve.add(sizeof(int64_t) * v.grid);
  v.off_base = carve.add(sizeof(int64_t));
  v.bytes = carve.total();
  return v;
}

// WRITE scratch: the control block, the clamped offsets, per-request counts and row starts, and the
// slot hash set (a power of two >= 2 x N, as there are at most N inserts, and >= 64).
struct WriteLayout {
  uint64_t table_size;
  size_t off_ctrl, off_o, off_rows, off_written, off_start, off_table, bytes;
};
WriteLayout write_layout(int64_t C, int64_t N) {
  WriteLayout w{};
  w.table_size = 64;
  while (w.table_size < 2 * static_cast<uint64_t>(N)) w.table_size <<= 1;
  ScratchCarver carve;
  w.off_ctrl = carve.add(sizeof(WriteCtrl));
  w.off_o = carve.add(sizeof(int64_t) * (C + 1));
  w.off_rows = carve.add(sizeof(int64_t) * C);
  w.off_written = carve.add(sizeof(int64_t) * C);
  w.off_start = carve.add(sizeof(int64_t) * C);
  w.off_table = carve.add(sizeof(unsigned long long) * w.table_size);
  w.bytes = carve.total();
  return w;
}

// PLAN scratch: the batch rows, their saturated verify starts and the number of entries to fill.
struct PlanLayout {
  size_t off_rows, off_vstart, off_filled, bytes;
};
PlanLayout plan_layout(int64_t bs) {
  PlanLayout p{};
  ScratchCarver carve;
  p.off_rows = carve.add(sizeof(PlanRow) * (bs > 0 ? bs : 1));
  p.off_vstart = carve.add(sizeof(int64_t) * (bs + 1));
  p.off_filled = carve.add(sizeof(int64_t));
  p.bytes = carve.total();
  return p;
}

}  // namespace

int64_t verify_scratch_bytes(int64_t capacity) { return static_cast<int64_t>(verify_layout(capacity).bytes); }
int64_t write_scratch_bytes(int64_t write_req_capacity, int64_t num_tokens) {
  return static_cast<int64_t>(write_layout(write_req_capacity, num_tokens).bytes);
}
int64_t plan_scratch_bytes(int64_t batch_size) { return static_cast<int64_t>(plan_layout(batch_size).bytes); }

cudaError_t verify_enqueue(const VerifyArgs& a, int64_t capacity, const int32_t* num_valid, const int32_t* enable,
                           const LogView& log, ScratchView scratch, cudaStream_t stream) {
  const VerifyLayout v = verify_layout(capacity);
  if (scratch.bytes < v.bytes) return cudaErrorInvalidValue;
  VerifyLaunch L{};
  L.a = a;
  L.capacity = capacity;
  L.num_valid = num_valid;
  L.enable = enable;
  L.log = log;
  L.chunk = v.chunk;
  L.block_rows = carve_at<int64_t>(scratch, v.off_rows);
  L.base = carve_at<int64_t>(scratch, v.off_base);
  KVC_LAUNCH(verify_count_kernel, static_cast<unsigned>(v.grid), kVerifyThreads, stream, L);
  KVC_LAUNCH(verify_emit_kernel, static_cast<unsigned>(v.grid), kVerifyThreads, stream, L);
  return cudaGetLastError();
}

cudaError_t write_enqueue(const WriteArgs& a, IndexView offsets, int64_t capacity, int64_t num_tokens,
                          const int32_t* num_valid_reqs, const int32_t* chain_flag, const LogView& log,
                          ScratchView scratch, cudaStream_t stream) {
  const WriteLayout w = write_layout(capacity, num_tokens);
  if (scratch.bytes < w.bytes) return cudaErrorInvalidValue;
  WriteLaunch L{};
  L.a = a;
  L.chain_flag = chain_flag;
  L.offsets = offsets;
  L.C = capacity;
  L.N = num_tokens;
  L.num_valid_reqs = num_valid_reqs;
  L.log = log;
  L.table_mask = w.table_size - 1;
  L.ctrl = carve_at<WriteCtrl>(scratch, w.off_ctrl);
  L.o = carve_at<int64_t>(scratch, w.off_o);
  L.req_rows = carve_at<int64_t>(scratch, w.off_rows);
  L.req_written = carve_at<int64_t>(scratch, w.off_written);
  L.row_start = carve_at<int64_t>(scratch, w.off_start);
  L.table = carve_at<unsigned long long>(scratch, w.off_table);
  const cudaError_t err = cudaMemsetAsync(L.table, 0xFF, sizeof(unsigned long long) * w.table_size, stream);
  if (err != cudaSuccess) return err;
  const unsigned req_grid = static_cast<unsigned>(blocks_for(capacity, 1, kMaxGridBlocks));
  KVC_LAUNCH(write_prep_kernel, 1, kOneBlockThreads, stream, L);
  KVC_LAUNCH(write_count_kernel, req_grid, kWriteThreads, stream, L);
  KVC_LAUNCH(write_scan_kernel, 1, kOneBlockThreads, stream, L);
  KVC_LAUNCH(write_main_kernel, req_grid, kWriteThreads, stream, L);
  return cudaGetLastError();
}

cudaError_t plan_enqueue(const PlanArgs& a, int64_t bs, int64_t vcap, int64_t wcap, const PlanOut& out,
                         ScratchView scratch, cudaStream_t stream) {
  const PlanLayout p = plan_layout(bs);
  if (scratch.bytes < p.bytes) return cudaErrorInvalidValue;
  PlanLaunch L{};
  L.a = a;
  L.bs = bs;
  L.vcap = vcap;
  L.wcap = wcap;
  L.out = out;
  L.rows = carve_at<PlanRow>(scratch, p.off_rows);
  L.vstart = carve_at<int64_t>(scratch, p.off_vstart);
  L.filled = carve_at<int64_t>(scratch, p.off_filled);
  const int64_t work = vcap > wcap + 1 ? vcap : wcap + 1;
  const unsigned grid = static_cast<unsigned>(blocks_for(work, kPlanThreads, kMaxGridBlocks));
  KVC_LAUNCH(plan_rows_kernel, 1, kOneBlockThreads, stream, L);
  KVC_LAUNCH(plan_entries_kernel, grid, kPlanThreads, stream, L);
  return cudaGetLastError();
}

template <typename T>
cudaError_t scatter_enqueue(T* pool, int64_t rows, int64_t cols, IndexView flat, int64_t total, IndexView offsets,
                            IndexView req_pool_indices, int64_t bs, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0 || bs <= 0) return cudaSuccess;  // nothing is addressed
  const unsigned grid = static_cast<unsigned>(blocks_for(cols, kScatterThreads, kMaxGridBlocks));
  KVC_LAUNCH(scatter_kernel<T>, grid, kScatterThreads, stream, pool, rows, cols, flat, total, offsets,
             req_pool_indices, bs);
  return cudaGetLastError();
}
template cudaError_t scatter_enqueue<int32_t>(int32_t*, int64_t, int64_t, IndexView, int64_t, IndexView, IndexView,
                                              int64_t, cudaStream_t);
template cudaError_t scatter_enqueue<int64_t>(int64_t*, int64_t, int64_t, IndexView, int64_t, IndexView, IndexView,
                                              int64_t, cudaStream_t);

}  // namespace kvcanary
