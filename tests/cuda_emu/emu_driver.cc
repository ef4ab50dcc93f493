// tests/cuda_emu/emu_driver.cc: runs the CUDA launchers of cuda/cuda_kernels.cu on the CPU (through
// the cuda_runtime.h stand-in beside this file), behind a C ABI for ctypes (tests/test_cuda_emu.py).
//
// Built by the test with g++ together with cuda/cuda_kernels.cu (its own translation unit):
// -I tests/cuda_emu (first, for the stand-in) -I cuda. The core argument structs are filled from raw
// host arrays as the FFI handlers (csrc/ffi_handlers.h) fill them from buffers; the *_enqueue
// functions, the kernels and canary_core.h are the production code.
#include <cstdio>
#include <cstdlib>
#include <memory>

#include <cstring>

#include "cuda_geometry.h"
#include "cuda_kernels.h"

namespace kvcanary {
namespace {

// Scratch: a buffer of exactly the size the FFI wrapper gives the handler (cuda_scratch.h), filled
// with a pattern (the scratch result is uninitialised on a GPU). Asking for more fails the launch,
// as the handler's ResultScratch does.
struct EmuScratch {
  explicit EmuScratch(int64_t bytes) : size(static_cast<size_t>(bytes)), mem(new unsigned char[size]) {
    std::memset(mem.get(), 0xA5, size);
  }
  size_t size;
  std::unique_ptr<unsigned char[]> mem;
  ScratchView view() const { return ScratchView{mem.get(), size}; }
};

IndexView iv(const void* p, int is64) { return IndexView{p, is64 != 0}; }

RealKvSources sources(int32_t mode, int n, const void* const* data, const int64_t* rows, const int64_t* row_bytes,
                      const int64_t* page_size, const int64_t* bytes_per_token, const int64_t* read_bytes,
                      const int64_t* offset_bytes) {
  RealKvSources out{};
  out.mode = mode;
  out.count = 0;
  for (int k = 0; k < n && k < MAX_REAL_KV_SOURCES; ++k)
    out.src[out.count++] = make_source_view(static_cast<const uint8_t*>(data[k]), rows[k], row_bytes[k],
                                            page_size[k], bytes_per_token[k], read_bytes[k], offset_bytes[k], mode);
  if (out.count == 0) out.mode = static_cast<int32_t>(RealKvHashMode::NONE);
  if (out.mode == static_cast<int32_t>(RealKvHashMode::NONE)) out.count = 0;
  return out;
}

int report(cudaError_t e) {
  if (e == cudaSuccess) return 0;
  std::fprintf(stderr, "cuda_emu: launch failed: %s\n", cudaGetErrorName(e));
  return 1;
}

LogView log_view(uint8_t* ring, int64_t ring_cap, int32_t* write_index, uint8_t* kernel_counters,
                 uint8_t* slot_counters) {
  return LogView{ring, ring_cap, write_index, kernel_counters, slot_counters};
}

}  // namespace
}  // namespace kvcanary

using namespace kvcanary;

extern "C" {

// Index arrays: pointer + is64 flag. Sources: n, then per-source arrays of length n.
int kvc_emu_verify(uint8_t* canary, int64_t num_slots, int64_t stride, uint8_t* ring, int64_t ring_cap,
                   int32_t* write_index, uint8_t* kernel_counters, uint8_t* slot_counters, const void* slots,
                   int slots64, const void* tokens, int tokens64, const void* positions, int positions64,
                   const void* prevs, int prevs64, int64_t capacity, const int32_t* num_valid, const int32_t* enable,
                   int check_token, int64_t tag, int32_t mode, int nsrc, const void* const* src_data,
                   const int64_t* src_rows, const int64_t* src_row_bytes, const int64_t* page_size,
                   const int64_t* bytes_per_token, const int64_t* read_bytes, const int64_t* offset_bytes) {
  VerifyArgs a{};
  a.canary = CanaryView{canary, num_slots, stride};
  a.slots = iv(slots, slots64);
  a.tokens = iv(tokens, tokens64);
  a.positions = iv(positions, positions64);
  a.prevs = iv(prevs, prevs64);
  a.check_token = check_token != 0;
  a.sources = sources(mode, nsrc, src_data, src_rows, src_row_bytes, page_size, bytes_per_token, read_bytes,
                      offset_bytes);
  a.tag = tag;
  EmuScratch scratch(verify_scratch_bytes(capacity));
  return report(verify_enqueue(a, capacity, num_valid, enable,
                               log_view(ring, ring_cap, write_index, kernel_counters, slot_counters), scratch.view(),
                               nullptr));
}

int kvc_emu_write(uint8_t* canary, int64_t num_slots, int64_t stride, uint8_t* ring, int64_t ring_cap,
                  int32_t* write_index, uint8_t* kernel_counters, uint8_t* slot_counters, const int32_t* chain_flag,
                  const void* offsets, int offsets64, const void* seeds, int seeds64, int64_t capacity,
                  const int32_t* num_valid_reqs, const void* input_ids, int ids64, const void* positions,
                  int positions64, const void* locs, int locs64, int64_t num_tokens, int input_assert,
                  const void* exp_tokens, int exp_tokens64, const void* exp_positions, int exp_positions64,
                  int64_t tag, int32_t mode, int nsrc, const void* const* src_data, const int64_t* src_rows,
                  const int64_t* src_row_bytes, const int64_t* page_size, const int64_t* bytes_per_token,
                  const int64_t* read_bytes, const int64_t* offset_bytes) {
  WriteArgs a{};
  a.canary = CanaryView{canary, num_slots, stride};
  a.seeds = iv(seeds, seeds64);
  a.input_ids = iv(input_ids, ids64);
  a.positions = iv(positions, positions64);
  a.locs = iv(locs, locs64);
  a.exp_tokens = iv(exp_tokens, exp_tokens64);
  a.exp_positions = iv(exp_positions, exp_positions64);
  a.input_assert = input_assert != 0;
  a.chain_assert = false;
  a.sources = sources(mode, nsrc, src_data, src_rows, src_row_bytes, page_size, bytes_per_token, read_bytes,
                      offset_bytes);
  a.tag = tag;
  EmuScratch scratch(write_scratch_bytes(capacity, num_tokens));
  return report(write_enqueue(a, iv(offsets, offsets64), capacity, num_tokens, num_valid_reqs, chain_flag,
                              log_view(ring, ring_cap, write_index, kernel_counters, slot_counters), scratch.view(),
                              nullptr));
}

int kvc_emu_plan(const void* rpi, int rpi64, const void* prefix, int prefix64, const void* extend, int extend64,
                 int64_t bs, const void* r2t, int r2t64, int64_t R, int64_t Lcols, int has_row_starts,
                 const void* row_starts, int row_starts64, int64_t N, int has_lut, const void* lut,
                 int lut64, int64_t lut_len, int has_pool, const void* pool, int pool64, int64_t Rp, int64_t Cp,
                 const void* valid_lens, int valid_lens64, int64_t window, int64_t token_offset, int64_t vcap,
                 int64_t wcap, int32_t* slots, int32_t* tokens, int32_t* positions, int32_t* prevs,
                 int32_t* num_valid, int32_t* enable, int32_t* offsets, int32_t* seeds, int32_t* num_valid_reqs) {
  PlanArgs a{};
  a.req_pool_indices = iv(rpi, rpi64);
  a.prefix_lens = iv(prefix, prefix64);
  a.extend_seq_lens = iv(extend, extend64);
  a.req_to_token = iv(r2t, r2t64);
  a.R = R;
  a.L = Lcols;
  a.has_row_starts = has_row_starts != 0;
  a.row_starts = iv(row_starts, row_starts64);
  a.N = N;
  a.has_lut = has_lut != 0 && lut_len > 0;
  a.lut = iv(lut, lut64);
  a.lut_len = lut_len;
  a.has_pool = has_pool != 0;
  a.pool = iv(pool, pool64);
  a.Rp = Rp;
  a.Cp = Cp;
  a.valid_lens = iv(valid_lens, valid_lens64);
  a.window = window;
  a.token_offset = token_offset;
  const int64_t rows = bs < wcap ? bs : wcap;
  const PlanOut out{slots, tokens, positions, prevs, num_valid, enable, offsets, seeds, num_valid_reqs};
  EmuScratch scratch(plan_scratch_bytes(rows));
  return report(plan_enqueue(a, rows, vcap, wcap, out, scratch.view(), nullptr));
}

int kvc_emu_scatter(void* pool, int pool64, int64_t Rp, int64_t Cp, const void* flat, int flat64, int64_t total,
                    const void* offsets, int offsets64, const void* rpi, int rpi64, int64_t bs) {
  if (pool64)
    return report(scatter_enqueue(static_cast<int64_t*>(pool), Rp, Cp, iv(flat, flat64), total,
                                  iv(offsets, offsets64), iv(rpi, rpi64), bs, nullptr));
  return report(scatter_enqueue(static_cast<int32_t*>(pool), Rp, Cp, iv(flat, flat64), total,
                                iv(offsets, offsets64), iv(rpi, rpi64), bs, nullptr));
}

// The launch geometry this driver was built with (for the test's case sizes).
void kvc_emu_geometry(int64_t* out) {
  out[0] = KVC_VERIFY_THREADS;
  out[1] = KVC_VERIFY_MAX_BLOCKS;
  out[2] = KVC_WRITE_THREADS;
  out[3] = KVC_ONE_BLOCK_THREADS;
  out[4] = KVC_PLAN_THREADS;
  out[5] = KVC_SCATTER_THREADS;
  out[6] = KVC_MAX_GRID_BLOCKS;
}

}  // extern "C"
