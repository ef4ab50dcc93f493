"""Serving integration: config, in-step endpoints, host monitor, report format, health check,
sweep plans, fault injection, multi-device helpers, and KV that leaves the device (record
export/import, the host check, transfer packs) (docs/design.md §11, format.md §10-§11, §14)."""

from .config import CanaryConfig, launch_tag
from .endpoints import (CanaryBatch, CanaryEndpoints, CanaryState, GroupPlan,
                        set_chain_position_assert, translate_slots)
from .episodes import Episode, EpisodeLog
from .errors import CanaryHealthError, CanaryViolationError
from .health import HealthCheck
from .hostcheck import HostCheckResult, aligned_host_array, check_host_copy, check_records, host_tag
from .monitor import Monitor, Violation, counter_snapshot
from .offload import export_records, export_state_records, import_records, import_state_records
from .report import (REPORT_LINE_RE, ReportHeader, format_first_line, format_report,
                     parse_first_line)
from .stats import CounterSnapshot, format_stats_line
from .sweep import bucket_capacity, build_group_sweep_plans, build_sweep_plan, translate_chains
from .transfer import TransferError, TransferPack, pack_transfer, unpack_transfer
from . import perturb, multidevice

__all__ = [
    "CanaryConfig", "launch_tag", "CanaryBatch", "CanaryEndpoints", "CanaryState", "GroupPlan",
    "set_chain_position_assert", "translate_slots", "CanaryHealthError", "CanaryViolationError",
    "Episode", "EpisodeLog",
    "HealthCheck", "Monitor", "Violation", "counter_snapshot", "REPORT_LINE_RE", "ReportHeader",
    "format_first_line", "format_report", "parse_first_line", "CounterSnapshot", "format_stats_line", "bucket_capacity",
    "build_group_sweep_plans", "build_sweep_plan", "translate_chains", "perturb", "multidevice",
    "export_records", "import_records", "export_state_records", "import_state_records",
    "HostCheckResult", "aligned_host_array", "check_host_copy", "check_records", "host_tag",
    "TransferError", "TransferPack", "pack_transfer", "unpack_transfer",
]
