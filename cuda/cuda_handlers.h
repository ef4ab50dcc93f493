// cuda_handlers.h: the CUDA FFI handler symbols exported by cuda_handlers.cc.
#pragma once

#include "xla/ffi/api/ffi.h"

namespace kvcanary {
XLA_FFI_DECLARE_HANDLER_SYMBOL(kvcanary_verify_cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kvcanary_write_cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kvcanary_plan_cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kvcanary_scatter_cuda);
}  // namespace kvcanary
