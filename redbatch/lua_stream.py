"""Lua scripts of streaming models: one atomic step per batch step, and the reap.

Every key of a script is in the model's slot (its reply lists too: a streaming
request's ``reply_to`` must be ``reply_key``).  Constants come from ``protocol``.
"""

from __future__ import annotations

from typing import Final

from redbatch import protocol

_S = protocol.STREAMED_PREFIX

# KEYS[1]=inflight  KEYS[2]=queue  KEYS[3]=cancelled set
# KEYS[2+2j]=marker of message j (j = 1..n)  KEYS[3+2j]=its reply_to
# ARGV[1]=reply ttl s  ARGV[2]=room (entries to claim after the messages)
# ARGV[3]=inflight ttl ms  ARGV[4]=n, then 6 per message from b = 5 + 6(j-1):
# ARGV[b]=its raw entry  ARGV[b+1]=seq  ARGV[b+2]='1' if final  ARGV[b+3]=marker ttl ms
# ARGV[b+4]=the encoded message  ARGV[b+5]=request id
# Each message goes out only if its entry is still in this worker's in-flight list (a
# reaper that took the list over answers it instead) and its seq is the next one its
# marker expects (never a gap, never twice); a non-final message of a request in the
# cancelled set is dropped, and its entry acked.  A final message turns the marker to
# 'd' and acks the entry (LREM); a chunk turns it to 's<seq + 1>'.  Then up to
# room (+ the members dropped here) entries move from the queue to the in-flight list.
# Returns {{status of each message: 0 sent, 1 refused, 2 cancelled}, {claimed...}}.
STEP: Final = f"""
local n, room = tonumber(ARGV[4]), tonumber(ARGV[2])
local status = {{}}
for j = 1, n do
  local b, marker, to = 5 + 6 * (j - 1), KEYS[2 + 2 * j], KEYS[3 + 2 * j]
  local seq, final = tonumber(ARGV[b + 1]), ARGV[b + 2] == '1'
  local ours = redis.call('LPOS', KEYS[1], ARGV[b]) ~= false
  local m = ours and redis.pcall('GET', marker) or false
  if type(m) == 'table' then m = 'd' end  -- not a string (WRONGTYPE): never answered
  local expect = 0
  if m and string.sub(m, 1, 1) == '{_S}' then expect = tonumber(string.sub(m, 2)) end
  if not ours or m == 'd' or expect ~= seq then
    status[j] = 1
    if ours then redis.call('LREM', KEYS[1], 1, ARGV[b]) end
  elseif not final and redis.call('ZSCORE', KEYS[3], ARGV[b + 5]) then
    status[j] = 2
    redis.call('SET', marker, 'd', 'PX', ARGV[b + 3])
    redis.call('LREM', KEYS[1], 1, ARGV[b])
  else
    status[j] = 0
    redis.call('RPUSH', to, ARGV[b + 4])
    redis.call('EXPIRE', to, ARGV[1])
    if final then
      redis.call('SET', marker, 'd', 'PX', ARGV[b + 3])
      redis.call('LREM', KEYS[1], 1, ARGV[b])
    else
      redis.call('SET', marker, '{_S}' .. (seq + 1), 'PX', ARGV[b + 3])
    end
  end
  if status[j] ~= 0 and not final then room = room + 1 end
end
local items = {{}}
if room > 0 then items = redis.call('LPOP', KEYS[2], room) or {{}} end
for i = 1, #items, 1000 do
  redis.call('RPUSH', KEYS[1], unpack(items, i, math.min(i + 999, #items)))
end
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('PEXPIRE', KEYS[1], ARGV[3]) end
return {{status, items}}
"""

# KEYS[1]=the dead (or returning) worker's inflight  KEYS[2]=queue  KEYS[3]=dead letters
# KEYS[4]=workers zset  KEYS[5]=worker info  KEYS[4+2j]=marker of entry j (j = 1..n)
# KEYS[5+2j]=its reply_to
# ARGV[1]=worker id  ARGV[2]=now ms, or 'force' (a worker returning its own entries)
# ARGV[3]=sha1 hex of the in-flight entries read  ARGV[4]=reply ttl s
# ARGV[5]=dead-letter ttl s  ARGV[6]=nd  ARGV[7..6+nd]=dead letters (unreadable entries)
# ARGV[7+nd]=n, then 6 per entry from b = 8 + nd + 6(j-1): ARGV[b]=the entry to requeue
# ('' when it may not run again)  ARGV[b+1]=its raw entry  ARGV[b+2]=request id
# ARGV[b+3]='json' or 'msgpack'  ARGV[b+4]=marker ttl ms  ARGV[b+5]=error message
# An entry whose marker says chunks went out ('s<n>') is never run again (its chunks
# would repeat): its caller gets a final worker_crashed message numbered n.  An entry
# already answered ('d') is dropped.  The others go back to the queue's front, in order,
# or, when they may not run again, get a final worker_crashed message numbered 0 and
# are dead-lettered.  Returns the number requeued, -1 if the lease is live again, -2 if
# the in-flight list changed since it was read.
REAP: Final = f"""
if ARGV[2] ~= 'force' then
  local lease = redis.call('ZSCORE', KEYS[4], ARGV[1])
  if lease and tonumber(lease) > tonumber(ARGV[2]) then return -1 end
end
local entries = redis.call('LRANGE', KEYS[1], 0, -1)
if redis.sha1hex ~= nil and redis.sha1hex(table.concat(entries)) ~= ARGV[3] then
  return -2
end
local nd = tonumber(ARGV[6])
local dead = {{}}
for i = 7, 6 + nd do dead[#dead + 1] = ARGV[i] end
local n = tonumber(ARGV[7 + nd])
local function crashed(j, b, seq)
  local msg = {{v = {protocol.PROTOCOL_VERSION}, id = ARGV[b + 2], seq = seq, last = true,
    ok = false, error = {{code = 'worker_crashed', message = ARGV[b + 5]}}}}
  local data
  if ARGV[b + 3] == 'json' then data = cjson.encode(msg) else data = cmsgpack.pack(msg) end
  local to = KEYS[5 + 2 * j]
  local pushed = redis.pcall('RPUSH', to, data)  -- refused (WRONGTYPE): none to tell
  if type(pushed) ~= 'table' then redis.call('EXPIRE', to, ARGV[4]) end
  redis.call('SET', KEYS[4 + 2 * j], 'd', 'PX', ARGV[b + 4])
end
local requeue = {{}}
for j = 1, n do
  local b = 8 + nd + 6 * (j - 1)
  local m = redis.pcall('GET', KEYS[4 + 2 * j])
  if type(m) == 'table' then m = false end
  if m and string.sub(m, 1, 1) == '{_S}' then
    crashed(j, b, tonumber(string.sub(m, 2)))
  elseif m ~= 'd' then
    if ARGV[b] ~= '' then
      requeue[#requeue + 1] = ARGV[b]
    else
      crashed(j, b, 0)
      dead[#dead + 1] = ARGV[b + 1]
    end
  end
end
for i = #requeue, 1, -1 do redis.call('LPUSH', KEYS[2], requeue[i]) end
if #requeue > 0 then redis.call('PEXPIRE', KEYS[2], {protocol.QUEUE_TTL_S * 1000}) end
for i = 1, #dead do redis.call('RPUSH', KEYS[3], dead[i]) end
if #dead > 0 then
  redis.call('LTRIM', KEYS[3], -{protocol.DEAD_LETTER_MAX}, -1)
  redis.call('EXPIRE', KEYS[3], ARGV[5])
end
redis.call('DEL', KEYS[1])
if ARGV[2] ~= 'force' then
  redis.call('ZREM', KEYS[4], ARGV[1])
  redis.call('HDEL', KEYS[5], ARGV[1])
end
return #requeue
"""
