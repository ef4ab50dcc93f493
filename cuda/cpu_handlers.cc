// cpu_handlers.cc: the XLA FFI handlers for the CPU platform: the handlers of ffi_handlers.h with the
// sequential launchers of cpu_launchers.h. No handler returns an error for data.
#include <cstring>

#include "canary_core.h"
#include "cpu_handlers.h"
#include "cpu_launchers.h"
#include "ffi_handlers.h"

namespace kvcanary {
namespace {

struct CpuPlatform {
  using Context = ffi::ThreadPool;
  using Ctx = ffi::ThreadPool;

  static ffi::Error copy(Ctx, void* dst, const void* src, size_t bytes) {
    std::memcpy(dst, src, bytes);
    return ffi::Error::Success();
  }
  static ffi::Error verify(Ctx, const VerifyArgs& a, int64_t capacity, const int32_t* num_valid,
                           const int32_t* enable, const LogView& log, ScratchView) {
    verify_launch(a, capacity, num_valid[0], enable[0], log);
    return ffi::Error::Success();
  }
  static ffi::Error write(Ctx, const WriteArgs& a, IndexView offsets, int64_t capacity, int64_t num_tokens,
                          const int32_t* num_valid_reqs, const int32_t* chain_flag, const LogView& log,
                          ScratchView) {
    WriteArgs args = a;
    args.chain_assert = chain_flag[0] != 0;  // read once per launch
    write_launch(args, offsets, capacity, num_valid_reqs[0], num_tokens, log);
    return ffi::Error::Success();
  }
  static ffi::Error plan(Ctx, const PlanArgs& a, int64_t bs, int64_t vcap, int64_t wcap, const PlanOut& out,
                         ScratchView) {
    plan_launch(a, bs, vcap, wcap, out);
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(kvcanary_verify_cpu, verify_handler<CpuPlatform>, verify_binding<CpuPlatform>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(kvcanary_write_cpu, write_handler<CpuPlatform>, write_binding<CpuPlatform>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(kvcanary_plan_cpu, plan_handler<CpuPlatform>, plan_binding<CpuPlatform>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(kvcanary_scatter_cpu, scatter_handler<CpuPlatform>, scatter_binding<CpuPlatform>());

}  // namespace kvcanary
