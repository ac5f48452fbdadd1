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
* ``{ns}:claimends``  hash, the claimed chain's last hash -> its zset member: the worker *settles* its claim
  when it stores that chunk (`SETTLE_LUA`, with its index publish): the prefix is computed, so its weight
  leaves the load hash then, not ``ttl`` later. (Before, a burst's claims weighed for 30 s after their
  prefills ended, and the next new prefixes all went to the worker that had taken fewer of the old ones.)
  The claim itself (``claim:<h>``) lives on for ``ttl``: routers follow it until the index has the chunks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from chunkserve.cluster.index import IndexKeys, check_worker_id, encode_hash

# KEYS: claim, claims zset, load hash, claim ends. ARGV: (unused), ttl_ms, weight, hash, last hash, k, then k
# candidates (preference order) and the other live workers. Expires up to 256 claims per call (their weight
# leaves the load hash), then follows a live claim whose worker is live (a candidate or not: the caller judges
# its load), or claims the least loaded candidate. -> the worker. Time is Redis's own clock (``TIME``), so
# routers whose clocks disagree still expire one another's claims on time.
CLAIM_LUA = """
if redis.replicate_commands then redis.replicate_commands() end  -- Redis < 7: TIME before writes
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, 256)
for _, m in ipairs(expired) do
  local w, wt = string.match(m, '^([^\\t]+)\\t(%d+)\\t')
  local last = string.match(m, '^[^\\t]+\\t%d+\\t[^\\t]+\\t[^\\t]+\\t(.+)$')  -- absent in a 4-field member
  if w and redis.call('HINCRBY', KEYS[3], w, -tonumber(wt)) <= 0 then redis.call('HDEL', KEYS[3], w) end
  if last and redis.call('HGET', KEYS[4], last) == m then redis.call('HDEL', KEYS[4], last) end
  redis.call('ZREM', KEYS[2], m)
end
local owner = redis.call('GET', KEYS[1])
if owner then
  for i = 7, #ARGV do
    if ARGV[i] == owner then return owner end
  end
end
local best, low = nil, nil
for i = 7, 6 + tonumber(ARGV[6]) do
  local l = tonumber(redis.call('HGET', KEYS[3], ARGV[i]) or '0')
  if low == nil or l < low then best, low = ARGV[i], l end
end
redis.call('SET', KEYS[1], best, 'PX', ttl)
local member = best .. '\\t' .. ARGV[3] .. '\\t' .. ARGV[4] .. '\\t' .. now .. '\\t' .. ARGV[5]
redis.call('ZADD', KEYS[2], now + ttl, member)
redis.call('HINCRBY', KEYS[3], best, tonumber(ARGV[3]))
redis.call('HSET', KEYS[4], ARGV[5], member)
for i = 2, 4 do redis.call('PEXPIRE', KEYS[i], ttl) end
return best
"""

# KEYS: claims zset, load hash, claim ends. ARGV: worker, then the hashes it just stored. A stored hash that
# ends a live claim of this worker settles it: the claim's weight leaves the load hash. -> claims settled.
SETTLE_LUA = """
local n = 0
local prefix = ARGV[1] .. '\\t'
for i = 2, #ARGV do
  local m = redis.call('HGET', KEYS[3], ARGV[i])
  if m and string.sub(m, 1, #prefix) == prefix then
    redis.call('HDEL', KEYS[3], ARGV[i])
    if redis.call('ZREM', KEYS[1], m) == 1 then
      local wt = tonumber(string.match(m, '^[^\\t]+\\t(%d+)\\t'))
      if redis.call('HINCRBY', KEYS[2], ARGV[1], -wt) <= 0 then redis.call('HDEL', KEYS[2], ARGV[1]) end
      n = n + 1
    end
  end
end
return n
"""


def claim_keys(keys: IndexKeys, first_hash: int) -> list[str]:
    ns = keys.namespace
    return [f"{{{ns}}}:claim:{encode_hash(first_hash)}", *settle_keys(keys)]


def settle_keys(keys: IndexKeys) -> list[str]:
    ns = keys.namespace
    return [f"{{{ns}}}:claims", f"{{{ns}}}:coldload", f"{{{ns}}}:claimends"]


def claim_args(first_hash: int, candidates: Sequence[str], weight: int, ttl_ms: int,
               others: Sequence[str] = (), last_hash: int | None = None) -> list[Any]:
    """``candidates``: where a new claim may go, in preference order; ``others``: live workers a claim
    already made may stay on (overloaded ones: the router then decides whether to spill, as for a holder);
    ``last_hash``: the claimed chain's last chunk hash, whose store settles the claim (default: the first)."""
    if not candidates:
        raise ValueError("a claim needs at least one candidate worker")
    rest = [w for w in others if w not in candidates]
    last = first_hash if last_hash is None else last_hash
    return [0, max(1, int(ttl_ms)), max(1, int(weight)), encode_hash(first_hash), encode_hash(last),
            len(candidates), *(check_worker_id(w) for w in (*candidates, *rest))]
