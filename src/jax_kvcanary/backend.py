"""Which backend runs an op: the ``impl`` argument, ``JAX_KVCANARY_IMPL``, or a choice per platform.

* ``impl="ffi"`` / ``impl="xla"`` (or the environment variable ``JAX_KVCANARY_IMPL``) picks one
  backend everywhere: the native custom call, or the pure-JAX backend (``xla_impl.py``).
* ``impl=None`` (the default) chooses where the code is compiled. The op is one JAX primitive with a
  lowering rule per platform: the native custom call on every platform with a registered handler
  (cpu; cuda when the CUDA module is built), the pure-JAX backend on every other one. Only the rule
  of the platform being lowered for runs, so ``jax.jit(step)`` compiled for the CPU of a GPU machine,
  or one function exported for several platforms (the rules then become a conditional on the
  platform), each get their own backend, and the pure-JAX function is traced only where it is used.
  Outside ``jit`` the primitive runs through a cached ``jax.jit``, so the choice follows its
  arguments' device. Under ``vmap`` each batch element is one launch (``lax.map``), like the native
  wrappers' ``vmap_method``.

When a platform this process can run on (cpu, or cuda with a visible GPU) has no native handler,
the pure-JAX backend runs there: correct, but much slower. One ``NativeBackendWarning`` per process
says why (the native module's ImportError, or a module that was not built) and how to fix it.
``impl="xla"`` asked for explicitly never warns.
"""

from __future__ import annotations

import functools
import os
import warnings

import jax
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from . import _ffi

IMPL_ENV = "JAX_KVCANARY_IMPL"

#: Static (compile-time) options of each op.
STATIC = {
    "verify": ("tag", "check_verify_expected_token", "real_kv_hash_mode"),
    "write": ("tag", "enable_write_input_assert", "real_kv_hash_mode"),
    "plan": ("verify_capacity", "write_req_capacity", "swa_window_size", "kv_token_id_vs_position_offset",
             "report_evicted_in_window"),
    "scatter_req_token_ids": (),
}

# lax.platform_dependent's name of each device platform that can have a native handler.
_LOWERING_NAME = {"cpu": "cpu", "gpu": "cuda"}
_MODULE = {"cpu": "jax_kvcanary._kvcanary (CPU handlers)", "gpu": "jax_kvcanary._kvcanary_cuda (CUDA handlers)"}


class NativeBackendWarning(UserWarning):
    """The native handlers are missing for a platform this process runs on; the pure-JAX backend is
    used there instead."""


# ---- [IMPL] -------------------------------------------------------------------------------------
def requested(impl) -> str | None:
    """The backend asked for: ``'ffi'``, ``'xla'``, or ``None`` (choose per platform). Checks
    ``impl`` and ``JAX_KVCANARY_IMPL`` (format §7.2 [IMPL])."""
    if impl is None:
        env = os.environ.get(IMPL_ENV)
        if env:
            if env not in ("ffi", "xla"):
                raise ValueError(f"kv-canary: {IMPL_ENV} must be 'ffi' or 'xla', got {env!r}")
            return env
        return None
    if impl not in ("ffi", "xla"):
        raise ValueError(f"kv-canary: impl must be 'ffi' or 'xla', got {impl!r}")
    return impl


def _platform_of(x) -> str:
    """Device platform of a concrete array, else the default backend's (tracers carry no device)."""
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        try:
            return next(iter(x.devices())).platform
        except Exception:  # noqa: BLE001 - deleted or abstract arrays: fall back
            pass
    return jax.default_backend()


def resolve(impl, like=None) -> str:
    """``'ffi'``, ``'xla'`` or ``'auto'`` (per platform) for an op whose arguments include ``like``.
    An explicit ``'ffi'`` needs a native handler for the platform of ``like``."""
    choice = requested(impl)
    if choice == "ffi":
        platform = _platform_of(like)
        if platform not in _ffi.NATIVE_PLATFORMS:
            raise ValueError(f"kv-canary: impl='ffi' has no native handler for platform {platform!r}; "
                             "use impl='xla'")
    return choice or "auto"


# ---- why a platform has no native handler -------------------------------------------------------
def fallback_reason(platform: str) -> str | None:
    """Why device platform ``platform`` (``'cpu'``, ``'gpu'``) runs the pure-JAX backend under
    ``impl=None``, or None when it has native handlers."""
    if platform in _ffi.NATIVE_PLATFORMS:
        return None
    if platform not in _MODULE:
        return f"jax_kvcanary has no native handlers for platform {platform!r}"
    if platform in _ffi.REFUSED:
        return f"{_MODULE[platform]} was not registered: {_ffi.REFUSED[platform]}"
    error = _ffi.IMPORT_ERRORS.get(platform, "")
    if error.startswith("ModuleNotFoundError") and _MODULE[platform].split()[0] in error:
        if platform == "gpu":
            return (f"{_MODULE[platform]} was not built (no nvcc when the package was built, or "
                    "JAX_KVCANARY_CUDA=off)")
        return f"{_MODULE[platform]} was not built"
    return f"{_MODULE[platform]} could not be imported: {error}"


_FIX = {
    "cpu": "reinstall the package so its native module is built (`pip install .` in a checkout; it needs "
           "CMake and a C++17 compiler; see BUILD.md)",
    "gpu": "reinstall with nvcc on PATH and `JAX_KVCANARY_CUDA=on pip install .` (see BUILD.md)",
}
_warned = False


def _has_devices(platform: str) -> bool:
    try:
        return bool(jax.devices(platform))
    except RuntimeError:
        return False


def warn_fallback(platform: str) -> None:
    """Once per process: warn that ``platform`` runs the pure-JAX backend, if this process has
    devices of that platform."""
    global _warned
    reason = fallback_reason(platform)
    if _warned or reason is None or platform not in _FIX or not _has_devices(platform):
        return
    _warned = True
    fix = "" if platform in _ffi.REFUSED else f" To fix: {_FIX[platform]}."  # a refusal names its fix
    warnings.warn(
        f"kv-canary: the native {platform.upper()} handlers are not available, so the ops run on the "
        f"pure-JAX backend there (correct, but much slower): {reason}.{fix} "
        "Pass impl='xla' to choose the pure-JAX backend explicitly.", NativeBackendWarning, stacklevel=4)


def describe(platform: str | None = None) -> tuple[str, str | None]:
    """``(impl, reason)`` of what ``impl=None`` runs on ``platform`` (default: the default backend):
    ``('ffi', None)``, or ``('xla', why)``. ``JAX_KVCANARY_IMPL`` wins, as in the ops."""
    platform = platform or jax.default_backend()
    choice = requested(None)
    if choice == "xla":
        return "xla", f"{IMPL_ENV}=xla"
    reason = fallback_reason(platform)
    return ("ffi", None) if reason is None else ("xla", reason)


# ---- the callables ------------------------------------------------------------------------------
def _xla_op(name):
    from . import xla_impl
    return getattr(xla_impl, name)


@functools.lru_cache(maxsize=None)
def _jitted_xla(name):
    """The pure-JAX op as one cached jax.jit: eager calls compile once per shape."""
    return jax.jit(_xla_op(name), static_argnames=STATIC[name])


# impl=None: one primitive per op whose lowering rule is chosen per lowering platform. Its operands
# are the flattened (args, dynamic kwargs) of the op; `in_tree` rebuilds them and `statics` holds the
# static options. A platform with native handlers lowers the op's ffi_call; every other platform
# lowers the pure-JAX function, which is traced only then.
def _flat_fn(fn, in_tree, statics):
    def run(*flat):
        args, kwargs = jax.tree_util.tree_unflatten(in_tree, flat)
        return jax.tree_util.tree_leaves(fn(*args, **kwargs, **dict(statics)))
    return run


@functools.lru_cache(maxsize=None)
def _out_shapes(name, in_tree, statics, in_avals):
    """Shapes of the op's outputs (flat, and their tree): the native wrapper's result declarations,
    which every backend matches."""
    args, kwargs = jax.tree_util.tree_unflatten(in_tree, [jax.ShapeDtypeStruct(*a) for a in in_avals])
    out = jax.eval_shape(functools.partial(getattr(_ffi, name), **dict(statics)), *args, **kwargs)
    return jax.tree_util.tree_flatten(out)


def _abstract_eval(name, *avals, in_tree, statics):
    flat, _ = _out_shapes(name, in_tree, statics, tuple((a.shape, a.dtype) for a in avals))
    return [jax.core.ShapedArray(s.shape, s.dtype) for s in flat]


def _native_rule(name):
    def rule(ctx, *flat, in_tree, statics):
        return mlir.lower_fun(_flat_fn(getattr(_ffi, name), in_tree, statics), multiple_results=True)(ctx, *flat)
    return rule


def _fallback_rule(name):
    def rule(ctx, *flat, in_tree, statics):
        for lowering_name in ctx.module_context.platforms:
            for platform, known in _LOWERING_NAME.items():
                if known == lowering_name:
                    warn_fallback(platform)
        return mlir.lower_fun(_flat_fn(_xla_op(name), in_tree, statics), multiple_results=True)(ctx, *flat)
    return rule


def _batch_sequential(prim, args, dims, **params):
    """vmap: one launch per batch element (lax.map), as the native wrappers' vmap_method does."""
    mapped = [i for i, d in enumerate(dims) if d is not None]
    moved = [jax.numpy.moveaxis(args[i], dims[i], 0) for i in mapped]

    def one(xs):
        full = list(args)
        for i, x in zip(mapped, xs):
            full[i] = x
        return prim.bind(*full, **params)

    out = jax.lax.map(one, moved)
    return out, [0] * len(out)


@functools.lru_cache(maxsize=None)
def _primitive(name):
    prim = Primitive(f"kvcanary_{name}")
    prim.multiple_results = True
    prim.def_impl(lambda *flat, **params: _jitted_bind(prim, tuple(params.items()))(*flat))
    prim.def_abstract_eval(functools.partial(_abstract_eval, name))
    mlir.register_lowering(prim, _fallback_rule(name))
    for platform, lowering_name in _LOWERING_NAME.items():
        if platform in _ffi.NATIVE_PLATFORMS:
            mlir.register_lowering(prim, _native_rule(name), platform=lowering_name)
    batching.primitive_batchers[prim] = functools.partial(_batch_sequential, prim)
    return prim


@functools.lru_cache(maxsize=None)
def _jitted_bind(prim, params):
    """Eager calls: the primitive staged into a cached jax.jit, so it lowers for its arguments' device."""
    return jax.jit(lambda *flat: prim.bind(*flat, **dict(params)))


def _per_platform(name):
    def run(*args, **kwargs):
        statics = tuple((k, kwargs.pop(k)) for k in STATIC[name])
        flat, in_tree = jax.tree_util.tree_flatten((args, kwargs))
        avals = tuple((tuple(x.shape), jax.numpy.dtype(x.dtype)) for x in flat)
        _, out_tree = _out_shapes(name, in_tree, statics, avals)
        out = _primitive(name).bind(*flat, in_tree=in_tree, statics=statics)
        return jax.tree_util.tree_unflatten(out_tree, out)
    return run


def op(name: str, choice: str):
    """The implementation of op ``name`` for a ``resolve()`` result."""
    if choice == "ffi":
        return getattr(_ffi, name)
    if choice == "xla":
        return _jitted_xla(name)
    return _per_platform(name)
