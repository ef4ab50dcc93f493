// cuda_handlers.cc: the XLA FFI handlers for the CUDA platform: the handlers of ffi_handlers.h with
// the launchers of cuda_kernels.h on XLA's stream. Graph-safe: no host sync, no allocation (scratch is
// the call's last result), declared kCmdBufferCompatible.
#include <cuda_runtime.h>

#include <string>

#include "canary_core.h"
#include "cuda_handlers.h"
#include "cuda_kernels.h"
#include "ffi_handlers.h"

namespace kvcanary {
namespace {

ffi::Error cuda_error(const char* what, cudaError_t err) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("kv-canary: CUDA ") + what + " failed: " + cudaGetErrorName(err) + ": " +
                              cudaGetErrorString(err));
}

// The device core accesses 64-bit fields with 8-byte loads (canary_core.h). XLA buffers are at least
// 16-byte aligned, so this never fires; it turns a would-be misaligned-address fault into an error.
bool aligned8(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 7u) == 0; }
bool aligned(const CanaryView& c, const LogView& log, const RealKvSources& s) {
  bool ok = aligned8(c.data) && c.stride % 8 == 0 && aligned8(log.ring) && aligned8(log.kernel_counters) &&
            aligned8(log.slot_counters);
  for (int k = 0; k < s.count; ++k) ok = ok && aligned8(s.src[k].data);
  return ok;
}
ffi::Error misaligned() {
  return ffi::Error::Internal("kv-canary: CUDA handler got a buffer that is not 8-byte aligned");
}

struct CudaPlatform {
  using Context = ffi::PlatformStream<cudaStream_t>;
  using Ctx = cudaStream_t;

  static ffi::Error copy(Ctx stream, void* dst, const void* src, size_t bytes) {
    return cuda_error("cudaMemcpyAsync", cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
  }
  static ffi::Error verify(Ctx stream, const VerifyArgs& a, int64_t capacity, const int32_t* num_valid,
                           const int32_t* enable, const LogView& log, ScratchView scratch) {
    if (!aligned(a.canary, log, a.sources)) return misaligned();
    return cuda_error("verify launch", verify_enqueue(a, capacity, num_valid, enable, log, scratch, stream));
  }
  static ffi::Error write(Ctx stream, const WriteArgs& a, IndexView offsets, int64_t capacity, int64_t num_tokens,
                          const int32_t* num_valid_reqs, const int32_t* chain_flag, const LogView& log,
                          ScratchView scratch) {
    if (!aligned(a.canary, log, a.sources)) return misaligned();
    return cuda_error("write launch", write_enqueue(a, offsets, capacity, num_tokens, num_valid_reqs, chain_flag,
                                                    log, scratch, stream));
  }
  static ffi::Error plan(Ctx stream, const PlanArgs& a, int64_t bs, int64_t vcap, int64_t wcap, const PlanOut& out,
                         ScratchView scratch) {
    return cuda_error("plan launch", plan_enqueue(a, bs, vcap, wcap, out, scratch, stream));
  }
  template <class T>
  static ffi::Error scatter(Ctx stream, T* pool, int64_t rows, int64_t cols, IndexView flat, int64_t total,
                            IndexView offsets, IndexView req_pool_indices, int64_t bs) {
    return cuda_error("scatter launch",
                      scatter_enqueue(pool, rows, cols, flat, total, offsets, req_pool_indices, bs, stream));
  }
};

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kvcanary_verify_cuda, verify_handler<CudaPlatform>, verify_binding<CudaPlatform>(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(kvcanary_write_cuda, write_handler<CudaPlatform>, write_binding<CudaPlatform>(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(kvcanary_plan_cuda, plan_handler<CudaPlatform>, plan_binding<CudaPlatform>(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(kvcanary_scatter_cuda, scatter_handler<CudaPlatform>, scatter_binding<CudaPlatform>(),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace kvcanary
