"""Host-side KV bookkeeping of the toy engine: slot allocator and a token-level prefix cache."""

from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np


class SlotAllocator:
    """Free list over slots ``1 .. num_slots-1`` (slot 0 is the padding slot, never handed out).

    Freed slots are handed out again first (LIFO), so slot reuse happens early and often.
    """

    def __init__(self, num_slots: int):
        self.num_slots = int(num_slots)
        self._free = list(range(self.num_slots - 1, 0, -1))
        self._live = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> List[int]:
        if n > len(self._free):
            raise RuntimeError(f"toy engine: out of KV slots (need {n}, {len(self._free)} free)")
        out = [self._free.pop() for _ in range(n)]
        self._live.update(out)
        return out

    def free(self, slots) -> None:
        for s in slots:
            s = int(s)
            if s not in self._live:
                raise RuntimeError(f"toy engine: double free of slot {s}")
            self._live.remove(s)
            self._free.append(s)

    def live(self) -> List[int]:
        return sorted(self._live)


class Node:
    """One cached token: its slot, position (= depth) and tree links. ``ref`` counts running
    requests that hold it. ``host_slot`` is set while the node's KV lives in the offload tier
    (its device ``slot`` is then -1); a resident node's ancestors are resident."""

    __slots__ = ("token", "slot", "depth", "parent", "children", "ref", "host_slot")

    def __init__(self, token: int, slot: int, depth: int, parent: Optional["Node"]):
        self.token, self.slot, self.depth, self.parent = token, slot, depth, parent
        self.children: Dict[int, Node] = {}
        self.ref = 0
        self.host_slot: Optional[int] = None


class PrefixCache:
    """A token-level radix tree of prompt prefixes (one node per token, position = depth)."""

    def __init__(self):
        self.root = Node(-1, -1, -1, None)
        self.num_nodes = 0

    def match(self, tokens) -> List[Node]:
        """The nodes of the longest cached prefix of ``tokens``."""
        out, node = [], self.root
        for t in tokens:
            node = node.children.get(int(t))
            if node is None:
                break
            out.append(node)
        return out

    def insert(self, tokens, slots) -> List[Node]:
        """Insert ``tokens`` stored in ``slots``; existing nodes keep their (donor) slot. Returns
        the node of every position: a caller whose slot differs from ``node.slot`` remaps to it."""
        out, node = [], self.root
        for depth, (t, s) in enumerate(zip(tokens, slots)):
            child = node.children.get(int(t))
            if child is None:
                child = Node(int(t), int(s), depth, node)
                node.children[int(t)] = child
                self.num_nodes += 1
            out.append(child)
            node = child
        return out

    def nodes(self) -> List[Node]:
        """Every node, depth-first (parents before children)."""
        out, stack = [], list(reversed(list(self.root.children.values())))
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(reversed(list(n.children.values())))
        return out

    def chains(self) -> np.ndarray:
        """``int64[n, 3]``: ``(slot, position, prev_slot)`` of every device-resident cached node
        (prev -1 at a root child): what a SWEEP verifies."""
        rows = [(n.slot, n.depth, n.parent.slot if n.parent is not self.root else -1)
                for n in self.nodes() if n.host_slot is None]
        return np.asarray(rows, np.int64).reshape(-1, 3)

    def slots(self) -> set:
        return {n.slot for n in self.nodes()}

    def unused_nodes(self) -> List[Node]:
        """Device-resident cached nodes that no running request references (parents first)."""
        return [n for n in self.nodes() if n.ref == 0 and n.host_slot is None]
