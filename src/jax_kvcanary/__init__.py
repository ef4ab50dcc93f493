"""jax_kvcanary: a KV-cache integrity checker for JAX serving engines (port of SGLang's kv-canary).

Importing the package registers the native FFI targets (CPU, and CUDA when built) if the native
module is present; without it, the pure-JAX backend (``impl="xla"``) still works.
"""

from . import consts
from .consts import (
    CANARY_ANCHOR_HASH,
    CANARY_CHAIN_ANCHOR,
    CANARY_SLOT_BYTES,
    DEFAULT_RING_CAPACITY,
    MAX_REAL_KV_SOURCES,
    NUM_LAUNCH_TAGS,
    VIOLATION_FIELDS,
    FailReason,
    HostCheckTag,
    IndexKind,
    LaunchTag,
    RealKvHashMode,
)
from .errors import KvCanaryTypeError
from .inputs import RealKvSource, VerifyPlan, WritePlan
from .state import ViolationLog, ViolationRow, canary_fields, decode_row, new_canary_buffer
from .ops import plan, scatter_req_token_ids, verify, write
from . import _ffi  # noqa: E402  (registers the native FFI targets)
from ._ffi import cpu_threads, set_cpu_threads

__all__ = [
    "CANARY_ANCHOR_HASH", "CANARY_CHAIN_ANCHOR", "CANARY_SLOT_BYTES", "DEFAULT_RING_CAPACITY",
    "MAX_REAL_KV_SOURCES", "NUM_LAUNCH_TAGS", "VIOLATION_FIELDS", "FailReason", "HostCheckTag", "IndexKind", "LaunchTag",
    "RealKvHashMode", "KvCanaryTypeError", "RealKvSource", "VerifyPlan", "WritePlan", "ViolationLog",
    "ViolationRow", "canary_fields", "cpu_threads", "decode_row", "new_canary_buffer", "plan", "scatter_req_token_ids",
    "set_cpu_threads", "verify", "write", "consts",
]
