"""Lua scripts for every multi-key step, so each one is atomic in Redis."""

from __future__ import annotations

from typing import Final

# KEYS[1]=queue  ARGV[1]=cap  ARGV[2]=queue ttl ms  ARGV[3..]=entries.
# Pushes as many entries as fit under the cap (in order) and returns how many.
ENQUEUE: Final = """
local room = tonumber(ARGV[1]) - redis.call('LLEN', KEYS[1])
local n = #ARGV - 2
if room < n then n = math.max(room, 0) end
if n > 0 then
  redis.call('RPUSH', KEYS[1], unpack(ARGV, 3, 2 + n))
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return n
"""

# KEYS[1]=queue  KEYS[2]=inflight  ARGV[1]=max count  ARGV[2]=inflight ttl ms.
# Moves up to ARGV[1] entries from the queue's head to the in-flight list's tail.
CLAIM: Final = """
local n = tonumber(ARGV[1])
local items = {}
if n > 0 then
  items = redis.call('LPOP', KEYS[1], n) or {}
end
if #items > 0 then
  redis.call('RPUSH', KEYS[2], unpack(items))
end
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
end
return items
"""
