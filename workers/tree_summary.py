"""A bounded, text-free summary of a worker's prefix forest, for the dashboard.

The tree (`prefix_tree.PrefixTree`) keeps refcounts, pins and an LRU tick per chunk; what it does not keep
is who used a chunk and how often it was reused. `ForestUsage` keeps that beside the tree, keyed by chunk id
and checked against the node object (a recycled chunk id starts afresh): per node the number of requests
that reused it (hits), the tenants whose requests ran through it (capped) and the wall time of the last use.

`summarize_forest(tree, usage)` walks the tree read-only and merges chains of single-child nodes with the
same refcount and pin state into runs. Each run reports its token and chunk counts, refcount, pinned flag,
hits, tenants and last use, never token ids or text. Per cache scope (the salt: a tenant id or a shared
group name) the top-level subtrees are ranked by tokens; the ``top_n`` largest of the whole forest are
kept and the rest summarised as counts, and at most ``max_runs`` runs are emitted in all.

Both run on the engine thread (the only thread that mutates the tree): `AsyncEngine` records a request's
use when its first token comes out and takes summaries through its inbox.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from chunkserve.workers.kvtree import Node
from chunkserve.workers.prefix_tree import PrefixTree

MAX_TENANTS_PER_NODE = 16


class _Use:
    __slots__ = ("node", "hits", "tenants", "last_use")

    def __init__(self, node: Node) -> None:
        self.node = node
        self.hits = 0
        self.tenants: set[str] = set()
        self.last_use = 0.0


class ForestUsage:
    """Hits, tenants and last use per chunk node (engine thread only)."""

    def __init__(self, clock: Any = time.time) -> None:
        self._use: dict[int, _Use] = {}
        self._clock = clock

    def __len__(self) -> int:
        return len(self._use)

    def get(self, node: Node) -> _Use | None:
        u = self._use.get(node.chunk)
        return u if u is not None and u.node is node else None

    def record(self, tree: PrefixTree, prompt: Sequence[int], salt: bytes, num_cached: int, tenant: str) -> int:
        """A request with ``prompt`` in scope ``salt`` ran, ``num_cached`` of its tokens served from the cache.
        Every cached full chunk of its prefix counts a use by ``tenant``; the reused ones also a hit.
        -> the number of nodes recorded."""
        if not len(prompt):
            return 0
        path, _ = tree._walk(np.asarray(prompt, dtype=np.int64), salt)  # full chunks only, no side effects
        c = tree.chunk_size
        now = self._clock()
        for i, node in enumerate(path):
            u = self.get(node)
            if u is None:
                u = self._use[node.chunk] = _Use(node)
            if i * c < num_cached:
                u.hits += 1
            if len(u.tenants) < MAX_TENANTS_PER_NODE:
                u.tenants.add(tenant)
            u.last_use = now
        return len(path)

    def prune(self, tree: PrefixTree) -> None:
        """Forget nodes that left the tree."""
        nodes = tree._nodes
        for chunk in [k for k, u in self._use.items() if nodes.get(k) is not u.node]:
            del self._use[chunk]


def _children(node: Node) -> list[Node]:
    return [*node.children.values(), *node.partials]


def _subtree_tokens(root: Node) -> dict[int, int]:
    """Tokens in each node's subtree (iterative post-order; keyed by id(node))."""
    out: dict[int, int] = {}
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        kids = _children(node)
        if done:
            out[id(node)] = len(node.tokens) + sum(out[id(k)] for k in kids)
        else:
            stack.append((node, True))
            stack.extend((k, False) for k in kids)
    return out


class _Emitter:
    def __init__(self, usage: ForestUsage | None, sizes: dict[int, int], max_runs: int) -> None:
        self.usage = usage
        self.sizes = sizes
        self.budget = max_runs
        self.emitted = 0

    def run(self, start: Node) -> dict[str, Any]:
        """The run starting at ``start`` (single-child chain, same ref and pin state) and its children."""
        self.budget -= 1
        self.emitted += 1
        nodes = [start]
        node = start
        while True:
            kids = _children(node)
            if len(kids) != 1 or kids[0].ref != start.ref or bool(kids[0].pinned) != bool(start.pinned):
                break
            node = kids[0]
            nodes.append(node)
        hits, last, tenants = 0, 0.0, set()
        for n in nodes:
            u = self.usage.get(n) if self.usage is not None else None
            if u is not None:
                hits = max(hits, u.hits)
                last = max(last, u.last_use)
                tenants |= u.tenants
        out: dict[str, Any] = {
            "tokens": sum(len(n.tokens) for n in nodes), "chunks": len(nodes), "depth": start.depth,
            "ref": start.ref, "pinned": bool(start.pinned), "hits": hits,
            "last_use": round(last, 3) if last else None, "tenants": sorted(tenants),
            "subtree_tokens": self.sizes[id(start)],
        }
        kids = sorted(_children(node), key=lambda k: -self.sizes[id(k)])
        out["children"], out["more"] = self.runs(kids)
        return out

    def runs(self, kids: list[Node]) -> tuple[list[dict[str, Any]], dict[str, int] | None]:
        shown: list[dict[str, Any]] = []
        rest = 0
        rest_tokens = 0
        for k in kids:
            if self.budget > 0:
                shown.append(self.run(k))
            else:
                rest += 1
                rest_tokens += self.sizes[id(k)]
        return shown, ({"subtrees": rest, "tokens": rest_tokens} if rest else None)


def summarize_forest(tree: PrefixTree, usage: ForestUsage | None = None, top_n: int = 32,
                     max_runs: int = 400) -> dict[str, Any]:
    """The forest as nested runs per scope, bounded (see the module docstring). Read-only on the tree."""
    if top_n < 1 or max_runs < 1:
        raise ValueError("top_n and max_runs must be >= 1")
    if usage is not None:
        usage.prune(tree)
    scopes: list[tuple[bytes, Node, dict[int, int]]] = []
    tops: list[tuple[int, int, Node]] = []  # (tokens, scope index, subtree root)
    for salt, root in tree._roots.items():
        sizes = _subtree_tokens(root)
        scopes.append((salt, root, sizes))
        tops.extend((sizes[id(k)], len(scopes) - 1, k) for k in _children(root))
    tops.sort(key=lambda t: (-t[0], t[1]))
    kept = {id(k) for _, _, k in tops[:top_n]}
    sizes_all: dict[int, int] = {}
    for _, _, s in scopes:
        sizes_all.update(s)
    em = _Emitter(usage, sizes_all, max_runs)
    out_scopes: list[dict[str, Any]] = []
    for salt, root, sizes in scopes:
        kids = sorted(_children(root), key=lambda k: -sizes[id(k)])
        shown = [k for k in kids if id(k) in kept]
        hidden = [k for k in kids if id(k) not in kept]
        runs, more = em.runs(shown)
        if hidden:
            more = more or {"subtrees": 0, "tokens": 0}
            more = {"subtrees": more["subtrees"] + len(hidden),
                    "tokens": more["tokens"] + sum(sizes[id(k)] for k in hidden)}
        total = sizes[id(root)]
        if total == 0 and not runs:
            continue
        out_scopes.append({"scope": salt.decode("utf-8", "replace"), "tokens": total, "runs": runs,
                           "more": more})
    out_scopes.sort(key=lambda s: -s["tokens"])
    return {"chunk_size": tree.chunk_size, "num_nodes": len(tree._nodes),
            "pinned_chunks": tree.num_pinned_chunks, "runs_shown": em.emitted, "scopes": out_scopes}
