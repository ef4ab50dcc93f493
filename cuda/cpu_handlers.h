// cpu_handlers.h: the CPU FFI handler symbols exported by cpu_handlers.cc.
#pragma once

#include "xla/ffi/api/ffi.h"

namespace kvcanary {
XLA_FFI_DECLARE_HANDLER_SYMBOL(kvcanary_verify_cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kvcanary_write_cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kvcanary_plan_cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kvcanary_scatter_cpu);
}  // namespace kvcanary
