// registrations.h: what both nanobind modules export, registrations() -> {FFI target name: capsule}.
// One target name per op on every platform: each module passes its own platform's four handlers and
// jax_kvcanary/_ffi.py registers them for that platform.
#pragma once

#include <nanobind/nanobind.h>

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

}  // namespace kvcanary
