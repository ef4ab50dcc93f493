"""Multi-device helpers: each device owns its KV shard, its canary buffers and its ring.

Per-device state is stored with a leading device axis ``[D, ...]`` sharded over a 1-D mesh axis, so
inside ``jax.shard_map`` each device sees its own ``[1, ...]`` block. ``local_view`` /
``global_view`` drop and restore that axis around the per-device step body; ``Monitor`` sees the
leading axis and labels every report with its device.

    mesh = device_mesh(4)
    state = stack_for_devices(endpoints.init_state(), mesh)
    def body(state, ...):
        s = local_view(state)
        s, ctx = endpoints.head(s, batch) ...
        return global_view(s), ...
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS), ...), out_specs=(P(AXIS), ...)),
                   donate_argnums=0)
"""

from __future__ import annotations

from typing import Optional

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXIS = "d"


def device_mesh(num_devices: Optional[int] = None, axis_name: str = AXIS) -> Mesh:
    """A 1-D mesh over the first ``num_devices`` devices (default: all)."""
    devs = jax.devices()
    n = len(devs) if num_devices is None else int(num_devices)
    if n < 1 or n > len(devs):
        raise ValueError(f"kv-canary: asked for {n} devices, {len(devs)} available "
                         "(on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    return Mesh(np.array(devs[:n]), (axis_name,))


def stack_for_devices(tree, mesh: Mesh, axis_name: str = AXIS):
    """Give every leaf a leading device axis (one copy per device), sharded over ``axis_name``."""
    n = mesh.shape[axis_name]
    sharding = NamedSharding(mesh, P(axis_name))

    def one(x):
        host = np.asarray(x)
        return jax.device_put(np.broadcast_to(host[None], (n,) + host.shape).copy(), sharding)

    return jax.tree.map(one, tree)


def shard_leading(tree, mesh: Mesh, axis_name: str = AXIS):
    """Place arrays that already have a leading ``[D, ...]`` axis, one block per device."""
    sharding = NamedSharding(mesh, P(axis_name))
    return jax.tree.map(lambda x: jax.device_put(x, sharding), tree)


def replicate(tree, mesh: Mesh):
    """Place arrays fully replicated on the mesh."""
    sharding = NamedSharding(mesh, P())
    return jax.tree.map(lambda x: jax.device_put(x, sharding), tree)


def local_view(tree):
    """Inside ``shard_map``: ``[1, ...]`` blocks -> the device's own ``[...]`` arrays."""
    return jax.tree.map(lambda x: x[0], tree)


def global_view(tree):
    """Inside ``shard_map``: the device's ``[...]`` arrays -> ``[1, ...]`` blocks for ``P(axis)``."""
    return jax.tree.map(lambda x: x[None], tree)
