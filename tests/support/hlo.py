"""Reading compiled (optimised) HLO text: input/output aliases and copies of state buffers."""

from __future__ import annotations

import re

import jax
import numpy as np

# The pure-JAX verify/write copy the 4-byte write_index while rebuilding it (a scalar, not a
# state-sized buffer); everything of 8 bytes or more must be updated in place, but for:
XLA_ALLOWED_COPIES = {"s32[1]"}
# from jax 0.11, XLA builds the pure-JAX backend's rebuilt run counters ([num_tags, 8] bytes: 96 whatever
# the cache size) in a new buffer and copies it into the donated output once per compiled step: at
# most one copy of each of the two counter arrays (xla_impl._counter_add).
XLA_COUNTER_COPIES = 2 if jax.__version_info__ >= (0, 11) else 0


def aliases(text):
    """{output tuple index: parameter number} of the entry computation."""
    header = next(line for line in text.splitlines() if line.startswith("HloModule"))
    m = re.search(r"input_output_alias=\{(.*?)\}, entry_computation_layout", header)
    assert m, f"no input_output_alias in the compiled module: {header[:300]}"
    return {tuple(int(x) for x in out.split(",") if x.strip()): int(param)
            for out, param in re.findall(r"\{([\d, ]*)\}: \((\d+), \{\}", m.group(1))}


def hoisted_constants(lowered_text):
    """How many parameters the entry computation has before the jitted function's own arguments:
    from jax 0.12, closed-over arrays (e.g. a step's real-KV sources) are lowered as leading
    ``jax.const`` parameters of ``main`` instead of literals, which shifts every argument's number."""
    main = next(line for line in lowered_text.splitlines() if "func.func public @main(" in line)
    args = re.split(r"%arg\d+: ", main.split(") -> ")[0])[1:]  # each: "tensor<...> {attributes}, "
    consts = [i for i, arg in enumerate(args) if "jax.const = true" in arg]
    assert consts == list(range(len(consts))), f"jax.const parameters not leading: {consts}"
    return len(consts)


def copies(text):
    """Shapes (e.g. 'u8[96,40]') of every copy instruction in the optimised module."""
    return [m.group(1) for m in re.finditer(r"= (\w+\[[\d,]*\])(?:\{[^}]*\})? copy(?:-start)?\(", text)]


_HLO_TYPES = {np.dtype(t): n for t, n in ((np.uint8, "u8"), (np.int32, "s32"), (np.uint32, "u32"),
                                            (np.int64, "s64"), (np.uint64, "u64"), (np.float32, "f32"))}


def state_shapes(*arrays):
    """HLO shape strings of ``arrays``, e.g. {'u8[96,40]', 's32[1]'}."""
    return {f"{_HLO_TYPES[np.dtype(a.dtype)]}[{','.join(str(d) for d in a.shape)}]" for a in arrays}


def state_copies(impl, text, state_leaves):
    """Copies in ``text`` whose shape is that of a state buffer (less what ``impl`` may copy)."""
    shapes = state_shapes(*state_leaves)
    bad = [c for c in copies(text) if c in shapes]
    if impl == "xla":
        bad = [c for c in bad if c not in XLA_ALLOWED_COPIES]
        counters = [c for c in bad if re.fullmatch(r"u8\[\d+,8\]", c)]
        bad = [c for c in bad if c not in counters] + counters[XLA_COUNTER_COPIES:]
    return bad
