"""The chunk hash chain shared by workers and the router.

``h_k = blake2b(h_{k-1} || salt || tokens of chunk k)`` over the *full* leading chunks of a prompt.
The salt is the tenant's cache scope (its id for private tenants, the group name for shared groups),
so equal prompts of different scopes never collide. The chain is stable across processes and
machines (never Python's ``hash``), and each hash is a 64-bit unsigned int.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

ROOT_HASH = 0


def chunk_hash(parent: int, salt: bytes, tokens: Sequence[int] | np.ndarray) -> int:
    """Hash of one chunk given its parent's hash, the scope salt and the chunk's token ids."""
    h = hashlib.blake2b(digest_size=8)
    h.update(parent.to_bytes(8, "little"))
    h.update(len(salt).to_bytes(2, "little"))
    h.update(salt)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little")


def hash_chain(token_ids: Sequence[int] | np.ndarray, chunk_size: int, salt: bytes = b"",
               max_chunks: int | None = None) -> list[int]:
    """Hashes of the leading full chunks of ``token_ids`` (at most ``max_chunks`` of them)."""
    arr = np.asarray(token_ids, dtype=np.int64)
    n = len(arr) // chunk_size
    if max_chunks is not None:
        n = min(n, max_chunks)
    out: list[int] = []
    parent = ROOT_HASH
    for k in range(n):
        parent = chunk_hash(parent, salt, arr[k * chunk_size:(k + 1) * chunk_size])
        out.append(parent)
    return out
