// cpu_handlers.cc: the XLA FFI handlers for the CPU platform: the handlers of ffi_handlers.h with the
// launchers of cpu_launchers.h, spread over XLA's intra-op thread pool (cpu_parallel.h) when a launch
// is large enough. No handler returns an error for data.
#include <atomic>
#include <cstring>
#include <utility>

#include "canary_core.h"
#include "cpu_handlers.h"
#include "cpu_launchers.h"
#include "ffi_handlers.h"

namespace kvcanary {
namespace {

std::atomic<int64_t> g_max_threads{0};  // 0: no cap

// XLA's intra-op thread pool as a cpu_parallel.h pool.
struct XlaPool {
  ffi::ThreadPool& pool;
  template <class F>
  void schedule(F&& f) {
    pool.Schedule(std::forward<F>(f));
  }
};

// The threads a launch may use: XLA's intra-op pool, capped by set_cpu_max_threads().
int64_t workers(ffi::ThreadPool& pool) {
  const int64_t cap = g_max_threads.load(std::memory_order_relaxed);
  const int64_t n = pool.num_threads();
  return cap > 0 && cap < n ? cap : n;
}

struct CpuPlatform {
  using Context = ffi::ThreadPool;
  using Ctx = ffi::ThreadPool;

  static ffi::Error copy(Ctx, void* dst, const void* src, size_t bytes) {
    std::memcpy(dst, src, bytes);
    return ffi::Error::Success();
  }
  static ffi::Error verify(Ctx pool, const VerifyArgs& a, int64_t capacity, const int32_t* num_valid,
                           const int32_t* enable, const LogView& log, ScratchView) {
    XlaPool threads{pool};
    verify_launch(a, capacity, num_valid[0], enable[0], log, PoolExecutor<XlaPool>(threads, workers(pool)));
    return ffi::Error::Success();
  }
  static ffi::Error write(Ctx pool, const WriteArgs& a, IndexView offsets, int64_t capacity, int64_t num_tokens,
                          const int32_t* num_valid_reqs, const int32_t* chain_flag, const LogView& log,
                          ScratchView) {
    WriteArgs args = a;
    args.chain_assert = chain_flag[0] != 0;  // read once per launch
    XlaPool threads{pool};
    write_launch(args, offsets, capacity, num_valid_reqs[0], num_tokens, log,
                 PoolExecutor<XlaPool>(threads, workers(pool)));
    return ffi::Error::Success();
  }
  static ffi::Error plan(Ctx pool, const PlanArgs& a, int64_t bs, int64_t vcap, int64_t wcap, const PlanOut& out,
                         ScratchView) {
    XlaPool threads{pool};
    plan_launch(a, bs, vcap, wcap, out, PoolExecutor<XlaPool>(threads, workers(pool)));
    return ffi::Error::Success();
  }
  template <class T>
  static ffi::Error scatter(Ctx, T* pool, int64_t rows, int64_t cols, IndexView flat, int64_t total,
                            IndexView offsets, IndexView req_pool_indices, int64_t bs) {
    scatter_launch(pool, rows, cols, flat, total, offsets, req_pool_indices, bs);
    return ffi::Error::Success();
  }
};

}  // namespace

void set_cpu_max_threads(int64_t n) { g_max_threads.store(n > 0 ? n : 0, std::memory_order_relaxed); }
int64_t cpu_max_threads() { return g_max_threads.load(std::memory_order_relaxed); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(kvcanary_verify_cpu, verify_handler<CpuPlatform>, verify_binding<CpuPlatform>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(kvcanary_write_cpu, write_handler<CpuPlatform>, write_binding<CpuPlatform>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(kvcanary_plan_cpu, plan_handler<CpuPlatform>, plan_binding<CpuPlatform>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(kvcanary_scatter_cpu, scatter_handler<CpuPlatform>, scatter_binding<CpuPlatform>());

}  // namespace kvcanary
