"""The canary inside sglang-jax (the JAX backend of SGLang), without editing sglang-jax's source.

Guard sglang-jax's own HTTP server with one command (``launch_server``)::

    python -m jax_kvcanary.integrations.sglang_jax.launch_server --kv-canary log \\
        --model-path DIR <any other sgl_jax.launch_server arguments>

or install it where your code builds sglang-jax's scheduler or model runner::

    import jax_kvcanary.integrations.sglang_jax as kvc_sgl
    canary = kvc_sgl.install_into_scheduler(scheduler, config)   # then canary.precompile(...)
    # or: kvc_sgl.install(model_runner, config, tree_cache=radix_cache)
    # flags: kvc_sgl.add_cli_args(parser); config = kvc_sgl.config_from_args(parser.parse_args())

Supported: sglang-jax 0.0.2 and its main branch (``layout``: the runner's layout decides, not a
version string), the overlap scheduler and the non-overlap one, page sizes 1 and above, the native
and fa attention backends, ``--enable-single-process``, the AOT dispatcher, tensor parallelism
(main: one canary state per device of the ``tensor`` axis, each checking its own KV heads), the
write-input assert and the token check (main: ``tokens``), EAGLE and EAGLE3 speculative decoding
with top-k 1 (the target model's KV, its non-fused path: ``speculative``).
The KV pools of ``pools.GUARDED`` (``MHATokenToKVPool``: every model served with it, MLA on the
native backend too; ``SWAKVPool``: FULL and SWA groups, native backend, one device).
Refused before start (``server.refusals``, ``server.model_refusals``): several nodes, data
parallelism, other speculative decoding (``speculative.refusals``), LoRA, multimodal, PD with Raiden / D2H / tensor parallelism,
HiCache's L3 tier, what the SWA guard lacks (``pools.swa_refusals``) and the other KV pools (MLA
latent, hybrid recurrent), by the pool class the engine would build; a scheduler that finds one
anyway ends the server before it serves.

Modules: ``canary`` (``SglangJaxCanary``: the wrapped model call and its checks), ``layout`` (the
engine's arrays as the canary addresses them), ``server`` (refusals, the guarded scheduler), ``speculative`` (EAGLE's
guard, refusals and health check), ``pools`` (which KV pool class
the engine builds, which ones are guarded),
``launch_server`` (the command), ``tokens`` (the intended tokens the write-input assert and the
token check read), ``request_guard`` (the requests a violation concerns, found before their
step's results are processed: aborted and their slots evicted in mode ``abort``, named in the log
in mode ``log``), ``metrics`` (the stats line, Prometheus counters), ``inject`` (faults for
testing), ``flags`` (the upstream flags).
Importing this package does not import sglang-jax.
"""

from .canary import SglangJaxCanary, install, install_into_scheduler, radix_chains
from .flags import REAL_DATA_CHOICES, add_cli_args, config_from_args
from .layout import fused_geometry, page_table_batch, real_kv_sources, segment_starts

__all__ = [
    "SglangJaxCanary", "install", "install_into_scheduler", "radix_chains", "REAL_DATA_CHOICES",
    "add_cli_args", "config_from_args", "fused_geometry", "page_table_batch", "real_kv_sources",
    "segment_starts",
]
