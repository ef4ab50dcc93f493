// registrations.h: what both nanobind modules export, registrations() -> {FFI target name: capsule}
// and build_info() -> {"jaxlib": the jaxlib whose XLA FFI headers compiled the handlers (CMake),
// "ffi_api": (major, minor) of those headers}.
// One target name per op on every platform: each module passes its own platform's four handlers and
// jax_kvcanary/_ffi.py registers them for that platform, unless the running jaxlib's XLA FFI API is
// older than "ffi_api" or of another major version (it would refuse the handlers).
#pragma once

#include <nanobind/nanobind.h>

#include "xla/ffi/api/c_api.h"

namespace kvcanary {

template <class Verify, class Write, class Plan, class Scatter>
nanobind::dict registrations(Verify* verify, Write* write, Plan* plan, Scatter* scatter) {
  nanobind::dict out;
  out["kvcanary_verify"] = nanobind::capsule(reinterpret_cast<void*>(verify));
  out["kvcanary_write"] = nanobind::capsule(reinterpret_cast<void*>(write));
  out["kvcanary_plan"] = nanobind::capsule(reinterpret_cast<void*>(plan));
  out["kvcanary_scatter"] = nanobind::capsule(reinterpret_cast<void*>(scatter));
  return out;
}

inline nanobind::dict build_info() {
  nanobind::dict out;
  out["jaxlib"] = KVCANARY_BUILD_JAXLIB_VERSION;
  out["ffi_api"] = nanobind::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
  return out;
}

}  // namespace kvcanary
