// cuda_module.cc: the nanobind module `jax_kvcanary._kvcanary_cuda`, exporting the CUDA FFI handler
// capsules (cuda_kernels.cu). registrations() maps each FFI target name to a capsule; the names are
// the CPU module's, so one ffi_call lowers to the native handler of either platform. jax_kvcanary/_ffi.py
// registers them for platform "CUDA". Importing this module needs no GPU and no CUDA driver: the
// CUDA runtime is linked statically and only initialises on the first launch.
#include <nanobind/nanobind.h>

#include "xla/ffi/api/ffi.h"

namespace kvcanary {
XLA_FFI_DECLARE_HANDLER_SYMBOL(kvcanary_verify_cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kvcanary_write_cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kvcanary_plan_cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kvcanary_scatter_cuda);
}  // namespace kvcanary

namespace nb = nanobind;

namespace {
template <typename T>
nb::capsule encapsulate(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}
}  // namespace

NB_MODULE(_kvcanary_cuda, m) {
  m.def("registrations", []() {
    nb::dict out;
    out["kvcanary_verify"] = encapsulate(kvcanary::kvcanary_verify_cuda);
    out["kvcanary_write"] = encapsulate(kvcanary::kvcanary_write_cuda);
    out["kvcanary_plan"] = encapsulate(kvcanary::kvcanary_plan_cuda);
    out["kvcanary_scatter"] = encapsulate(kvcanary::kvcanary_scatter_cuda);
    return out;
  });
}
