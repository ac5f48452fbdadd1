"""Cold-prefix claims: every router places a new prefix on the same worker, and new prefixes spread evenly.

A prefix nobody holds yet (a new tenant's system prompt) costs a full prefill wherever it goes, and the
index learns where it went only once that prefill ran. Until then each ingress replica's router would
decide on its own. Rendezvous hashing makes them agree but not spread: 4 new prompts on 2 workers land 3:1
or 4:0 for 5 of 8 prompt sets, and one worker then prefills 3-4 prompts while the other idles. A claim
settles both in one atomic script: the first router to see a prefix places it on the candidate with the
least claimed cold work (chunks of prefixes placed in the last ``ttl``; ties keep the caller's order,
rendezvous), and every later router follows that claim while it lives and its worker is a candidate.

Keys (all under the namespace's hash tag, so one Redis Cluster slot):

* ``{ns}:claim:<h>``  string, PX ttl: the worker a cold prefix (first chunk hash ``h``, signed) was placed on.
* ``{ns}:claims``     zset, member ``worker\\tweight\\th\\tnow`` -> expiry (ms): the live claims.
* ``{ns}:coldload``   hash, worker -> summed weight of its live claims (kept in step with the zset).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from chunkserve.cluster.index import IndexKeys, check_worker_id, encode_hash

# KEYS: claim, claims zset, load hash. ARGV: now_ms, ttl_ms, weight, hash, candidates (preference order).
# Expires up to 256 claims per call (their weight leaves the load hash), then follows a live claim whose
# worker is a candidate, or claims the least loaded candidate. -> the worker.
CLAIM_LUA = """
local now = tonumber(ARGV[1])
local ttl = tonumber(ARGV[2])
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, 256)
for _, m in ipairs(expired) do
  local w, wt = string.match(m, '^([^\\t]+)\\t(%d+)\\t')
  if w and redis.call('HINCRBY', KEYS[3], w, -tonumber(wt)) <= 0 then redis.call('HDEL', KEYS[3], w) end
  redis.call('ZREM', KEYS[2], m)
end
local owner = redis.call('GET', KEYS[1])
if owner then
  for i = 5, #ARGV do
    if ARGV[i] == owner then return owner end
  end
end
local best, low = nil, nil
for i = 5, #ARGV do
  local l = tonumber(redis.call('HGET', KEYS[3], ARGV[i]) or '0')
  if low == nil or l < low then best, low = ARGV[i], l end
end
redis.call('SET', KEYS[1], best, 'PX', ttl)
redis.call('ZADD', KEYS[2], now + ttl, best .. '\\t' .. ARGV[3] .. '\\t' .. ARGV[4] .. '\\t' .. ARGV[1])
redis.call('HINCRBY', KEYS[3], best, tonumber(ARGV[3]))
redis.call('PEXPIRE', KEYS[2], ttl)
redis.call('PEXPIRE', KEYS[3], ttl)
return best
"""


def claim_keys(keys: IndexKeys, first_hash: int) -> list[str]:
    ns = keys.namespace
    return [f"{{{ns}}}:claim:{encode_hash(first_hash)}", f"{{{ns}}}:claims", f"{{{ns}}}:coldload"]


def claim_args(first_hash: int, candidates: Sequence[str], weight: int, ttl_ms: int, now_ms: int) -> list[Any]:
    if not candidates:
        raise ValueError("a claim needs at least one candidate worker")
    return [int(now_ms), max(1, int(ttl_ms)), max(1, int(weight)), encode_hash(first_hash),
            *(check_worker_id(w) for w in candidates)]
