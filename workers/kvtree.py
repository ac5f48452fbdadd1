"""Prefix-tree nodes and sequences of the prefix-aware KV cache (PAKV).

A node is one chunk: up to ``c`` token ids and the pool id holding their K/V. Full chunks are
indexed in ``parent.children`` by their token tuple (and their keys kept sorted in ``child_keys``, so the
child sharing the most leading tokens with a prompt's tail is found in O(log n), `Node.closest_child`) and
can be shared by any number of sequences.
Partly filled chunks are leaves kept in ``parent.partials``; one shared by two sequences (after a
fork, or two identical prompts) is copied on write by whichever sequence appends first.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import numpy as np


class Node:
    """One chunk of the prefix tree."""

    __slots__ = ("chunk", "tokens", "parent", "children", "child_keys", "partials", "ref", "pinned",
                 "last_access", "hash", "depth", "indexed")

    def __init__(self, chunk: int, tokens: list[int], parent: Node | None, depth: int) -> None:
        self.chunk = chunk  # pool id; -1 for a root
        self.tokens = tokens  # token ids of this chunk, len <= c
        self.parent = parent
        self.children: dict[tuple[int, ...], Node] = {}  # full chunks by token tuple
        self.child_keys: list[tuple[int, ...]] = []  # the same keys, sorted (`add_child`, `detach`)
        self.partials: list[Node] = []  # partly filled leaves
        self.ref = 0  # live sequences whose path runs through this node
        self.pinned = 0  # pins held on this node (pinned nodes are never evicted)
        self.last_access = 0
        self.hash: int | None = None  # chain hash, set once the chunk is full and indexed
        self.depth = depth
        self.indexed = True  # False for a full chunk that duplicates an indexed sibling

    @property
    def num_children(self) -> int:
        return len(self.children) + len(self.partials)

    def add_child(self, key: tuple[int, ...], node: Node) -> None:
        """Index a full chunk under this node (``key``: its tokens, not yet a key here)."""
        self.children[key] = node
        bisect.insort(self.child_keys, key)

    def closest_child(self, tail: list[int]) -> tuple[Node | None, int]:
        """The full child sharing the most leading tokens with ``tail`` and how many (None, 0 when none shares
        any). In sorted order the longest common prefix with ``tail`` is at a neighbour of its insertion point,
        so this costs two comparisons whatever the number of children."""
        keys = self.child_keys
        i = bisect.bisect_left(keys, tuple(tail))
        best: tuple[int, ...] | None = None
        best_n = 0
        for key in keys[max(0, i - 1):i + 1]:
            n = common_prefix(key, tail)
            if n > best_n:
                best, best_n = key, n
        return (self.children[best], best_n) if best is not None else (None, 0)

    def detach(self) -> None:
        """Remove this node from its parent's indexes."""
        parent = self.parent
        if parent is None:
            return
        key = tuple(self.tokens)
        if parent.children.get(key) is self:
            del parent.children[key]
            keys = parent.child_keys
            del keys[bisect.bisect_left(keys, key)]
        else:
            with contextlib.suppress(ValueError):  # an unindexed duplicate full chunk is in neither
                parent.partials.remove(self)


def common_prefix(a: Seq[int], b: Seq[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n, m = 0, min(len(a), len(b))
    while n < m and a[n] == b[n]:
        n += 1
    return n


@dataclass
class Sequence:
    """A live sequence: its path of nodes from the root and the tokens still to be committed."""

    seq_id: int
    salt: bytes
    path: list[Node] = field(default_factory=list)
    length: int = 0  # tokens whose slots are committed in the tree
    pending: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    num_cached: int = 0  # leading tokens that were served from the cache at reserve time
    _key: tuple[int, ...] | None = None

    @property
    def leaf(self) -> Node | None:
        return self.path[-1] if self.path else None

    def key(self) -> tuple[int, ...]:
        """Chunk ids along the path; sorting sequences by it yields the tree order."""
        if self._key is None:
            self._key = tuple(n.chunk for n in self.path)
        return self._key

    def invalidate(self) -> None:
        self._key = None

    def token_ids(self) -> list[int]:
        out: list[int] = []
        for n in self.path:
            out.extend(n.tokens)
        return out
