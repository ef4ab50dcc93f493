// registrations.h: what both nanobind modules export, registrations() -> {FFI target name: capsule},
// constants() and build_info() -> {"jaxlib": the jaxlib whose XLA FFI headers compiled the handlers (CMake),
// "ffi_api": (major, minor) of those headers}.
// One target name per op on every platform: each module passes its own platform's four handlers and
// jax_kvcanary/_ffi.py registers them for that platform, unless the running jaxlib's XLA FFI API is
// older than "ffi_api" or of another major version (it would refuse the handlers).
#pragma once

#include <nanobind/nanobind.h>

#include "canary_core.h"
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

// constants() -> {name: value}: every constant and enum member of canary_core.h, as compiled;
// jax_kvcanary/_ffi.py compares them with consts.py (the Python source of truth) before it registers
// a module's handlers, and refuses a module built from other values.
inline nanobind::dict constants() {
  nanobind::dict out;
  out["CANARY_CHAIN_ANCHOR"] = CANARY_CHAIN_ANCHOR;
  out["CANARY_ANCHOR_HASH"] = CANARY_ANCHOR_HASH;
  out["SPLITMIX64_MUL1"] = SPLITMIX64_MUL1;
  out["SPLITMIX64_MUL2"] = SPLITMIX64_MUL2;
  out["SPLITMIX64_SHIFT1"] = SPLITMIX64_SHIFT1;
  out["SPLITMIX64_SHIFT2"] = SPLITMIX64_SHIFT2;
  out["SPLITMIX64_SHIFT3"] = SPLITMIX64_SHIFT3;
  out["REQ_POOL_IDX_PADDING"] = REQ_POOL_IDX_PADDING;
  out["TOKEN_TO_KV_SLOT_PADDING"] = TOKEN_TO_KV_SLOT_PADDING;
  out["CANARY_FIELDS_PER_SLOT"] = CANARY_FIELDS_PER_SLOT;
  out["CANARY_FIELD_TOKEN"] = CANARY_FIELD_TOKEN;
  out["CANARY_FIELD_POSITION"] = CANARY_FIELD_POSITION;
  out["CANARY_FIELD_PREV_HASH"] = CANARY_FIELD_PREV_HASH;
  out["CANARY_FIELD_REAL_KV_HASH"] = CANARY_FIELD_REAL_KV_HASH;
  out["CANARY_SLOT_BYTES"] = CANARY_SLOT_BYTES;
  out["VIOLATION_FIELDS"] = VIOLATION_FIELDS;
  out["VIOLATION_FIELD_KERNEL_KIND"] = VIOLATION_FIELD_KERNEL_KIND;
  out["VIOLATION_FIELD_SLOT_IDX"] = VIOLATION_FIELD_SLOT_IDX;
  out["VIOLATION_FIELD_POSITION"] = VIOLATION_FIELD_POSITION;
  out["VIOLATION_FIELD_STORED_TOKEN"] = VIOLATION_FIELD_STORED_TOKEN;
  out["VIOLATION_FIELD_EXPECTED_TOKEN"] = VIOLATION_FIELD_EXPECTED_TOKEN;
  out["VIOLATION_FIELD_STORED_CHAIN_HASH"] = VIOLATION_FIELD_STORED_CHAIN_HASH;
  out["VIOLATION_FIELD_EXPECTED_AUX"] = VIOLATION_FIELD_EXPECTED_AUX;
  out["VIOLATION_FIELD_FAIL_REASON_BITS"] = VIOLATION_FIELD_FAIL_REASON_BITS;
  out["VIOLATION_ROW_BYTES"] = VIOLATION_ROW_BYTES;
  out["COUNTER_BYTES"] = COUNTER_BYTES;
  out["MAX_REAL_KV_SOURCES"] = MAX_REAL_KV_SOURCES;
  out["REAL_KV_SOURCE_FIELDS_PER_ENTRY"] = REAL_KV_SOURCE_FIELDS_PER_ENTRY;
  out["REAL_KV_SOURCE_FIELD_PAGE_SIZE"] = REAL_KV_SOURCE_FIELD_PAGE_SIZE;
  out["REAL_KV_SOURCE_FIELD_NUM_BYTES_PER_TOKEN"] = REAL_KV_SOURCE_FIELD_NUM_BYTES_PER_TOKEN;
  out["REAL_KV_SOURCE_FIELD_READ_BYTES"] = REAL_KV_SOURCE_FIELD_READ_BYTES;
  out["REAL_KV_CHUNK_BYTES"] = REAL_KV_CHUNK_BYTES;
  out["REAL_KV_PARTIAL_BYTES"] = REAL_KV_PARTIAL_BYTES;
  out["NUM_LAUNCH_TAGS"] = NUM_LAUNCH_TAGS;
  out["DEFAULT_RING_CAPACITY"] = DEFAULT_RING_CAPACITY;
  out["WRITE_INDEX_MAX"] = WRITE_INDEX_MAX;
  out["FailReason.VERIFY_CHAIN_HASH_MISMATCH"] = static_cast<int64_t>(FailReason::VERIFY_CHAIN_HASH_MISMATCH);
  out["FailReason.VERIFY_POSITION_MISMATCH"] = static_cast<int64_t>(FailReason::VERIFY_POSITION_MISMATCH);
  out["FailReason.VERIFY_REAL_KV_HASH_MISMATCH"] = static_cast<int64_t>(FailReason::VERIFY_REAL_KV_HASH_MISMATCH);
  out["FailReason.WRITE_TOKEN_MISMATCH"] = static_cast<int64_t>(FailReason::WRITE_TOKEN_MISMATCH);
  out["FailReason.WRITE_POSITION_MISMATCH"] = static_cast<int64_t>(FailReason::WRITE_POSITION_MISMATCH);
  out["FailReason.VERIFY_TOKEN_MISMATCH"] = static_cast<int64_t>(FailReason::VERIFY_TOKEN_MISMATCH);
  out["FailReason.INDEX_OUT_OF_RANGE"] = static_cast<int64_t>(FailReason::INDEX_OUT_OF_RANGE);
  out["LaunchTag.HEAD_K_FULL"] = static_cast<int64_t>(LaunchTag::HEAD_K_FULL);
  out["LaunchTag.HEAD_V_FULL"] = static_cast<int64_t>(LaunchTag::HEAD_V_FULL);
  out["LaunchTag.TAIL_K_FULL"] = static_cast<int64_t>(LaunchTag::TAIL_K_FULL);
  out["LaunchTag.TAIL_V_FULL"] = static_cast<int64_t>(LaunchTag::TAIL_V_FULL);
  out["LaunchTag.SWEEP_K_FULL"] = static_cast<int64_t>(LaunchTag::SWEEP_K_FULL);
  out["LaunchTag.SWEEP_V_FULL"] = static_cast<int64_t>(LaunchTag::SWEEP_V_FULL);
  out["LaunchTag.HEAD_K_SWA"] = static_cast<int64_t>(LaunchTag::HEAD_K_SWA);
  out["LaunchTag.HEAD_V_SWA"] = static_cast<int64_t>(LaunchTag::HEAD_V_SWA);
  out["LaunchTag.TAIL_K_SWA"] = static_cast<int64_t>(LaunchTag::TAIL_K_SWA);
  out["LaunchTag.TAIL_V_SWA"] = static_cast<int64_t>(LaunchTag::TAIL_V_SWA);
  out["LaunchTag.SWEEP_K_SWA"] = static_cast<int64_t>(LaunchTag::SWEEP_K_SWA);
  out["LaunchTag.SWEEP_V_SWA"] = static_cast<int64_t>(LaunchTag::SWEEP_V_SWA);
  out["RealKvHashMode.NONE"] = static_cast<int64_t>(RealKvHashMode::NONE);
  out["RealKvHashMode.PARTIAL"] = static_cast<int64_t>(RealKvHashMode::PARTIAL);
  out["RealKvHashMode.ALL"] = static_cast<int64_t>(RealKvHashMode::ALL);
  out["IndexKind.WRITE_SLOT"] = static_cast<int64_t>(IndexKind::WRITE_SLOT);
  out["IndexKind.WRITE_SEED"] = static_cast<int64_t>(IndexKind::WRITE_SEED);
  out["IndexKind.VERIFY_SLOT"] = static_cast<int64_t>(IndexKind::VERIFY_SLOT);
  out["IndexKind.VERIFY_PREV"] = static_cast<int64_t>(IndexKind::VERIFY_PREV);
  out["IndexKind.REAL_KV_SOURCE_0"] = static_cast<int64_t>(IndexKind::REAL_KV_SOURCE_0);
  out["IndexKind.REAL_KV_SOURCE_1"] = static_cast<int64_t>(IndexKind::REAL_KV_SOURCE_1);
  out["IndexKind.REAL_KV_SOURCE_2"] = static_cast<int64_t>(IndexKind::REAL_KV_SOURCE_2);
  out["IndexKind.REAL_KV_SOURCE_3"] = static_cast<int64_t>(IndexKind::REAL_KV_SOURCE_3);
  return out;
}

}  // namespace kvcanary
