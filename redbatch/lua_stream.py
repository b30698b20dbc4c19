"""Lua scripts of streaming models: one atomic step per batch step, and the reap.

Every key of a script is in the model's slot (its reply lists too: a streaming
request's ``reply_to`` must be ``reply_key``).  Constants come from ``protocol``.
"""

from __future__ import annotations

from typing import Final

from redbatch import protocol

_S = protocol.STREAMED_PREFIX

# Shared by both scripts: push(to, data, ttl_s) is false when Redis refused the push (the
# reply_to holds a value of another type: a hostile or broken caller),
# final_error(...) a final error message, encoded as its request was, streamed(m) the
# next chunk number a request's marker holds (nil for anything but ``S<digits>``: a
# hostile ``Snan`` must not make a NaN that fails the script's encode), and
# cancelled(key, id) whether ``id`` is in the cancelled set ``key`` (a value of another
# type there cancels nothing: it must not fail every stream of the model).
_HELPERS: Final = f"""
local function push(to, data, ttl_s)
  local pushed = redis.pcall('RPUSH', to, data)
  if type(pushed) == 'table' then return false end
  if redis.call('EXPIRE', to, ttl_s, 'NX') == 0 then  -- a new list: set (as PUBLISH)
    redis.call('EXPIRE', to, ttl_s, 'GT')  -- else only ever longer: a reply waiting
  end                                       -- there keeps its own, longer TTL
  return true
end
local function streamed(m)  -- a marker's next chunk number; nil if it holds none
  local digits = m and string.match(m, '^{_S}(%d+)$')
  if digits and #digits <= 15 then return tonumber(digits) end
  return nil
end
local function cancelled(key, id)
  return type(redis.pcall('ZSCORE', key, id)) == 'string'
end
local function final_error(id, seq, fmt, code, message)
  local msg = {{v = {protocol.PROTOCOL_VERSION}, id = id, seq = seq, last = true,
    ok = false, error = {{code = code, message = message}}}}
  if fmt == 'json' then return cjson.encode(msg) end
  return cmsgpack.pack(msg)
end
"""

LOST: Final = ("the worker lost track of this stream (its marker expired or changed); "
               "its stream ends here")

# KEYS[1]=inflight  KEYS[2]=queue  KEYS[3]=cancelled set
# KEYS[2+2j]=marker of message j (j = 1..n)  KEYS[3+2j]=its reply_to
# ARGV[1]=reply ttl s  ARGV[2]=room (entries to claim after the messages; -1: claim
# nothing, not even in the places of members dropped here: a fixed batch, or stopping)
# ARGV[3]=inflight ttl ms  ARGV[4]=n, then 6 per message from b = 5 + 6(j-1):
# ARGV[b]=its raw entry  ARGV[b+1]=seq  ARGV[b+2]='1' if final  ARGV[b+3]=marker ttl ms
# ARGV[b+4]=the encoded message  ARGV[b+5]=request id
# Each message goes out only if its entry is still in this worker's in-flight list (a
# reaper that took the list over answers it instead) and its seq is the next one its
# marker expects (never a gap, never twice); a non-final message of a request in the
# cancelled set is dropped, and its entry acked.  A final message turns the marker to
# 'd' and acks the entry (LREM); a chunk turns it to 's<seq + 1>'.  An entry still ours
# whose marker expects another seq ends with a final 'internal' error (numbered as the
# marker expects).  A push Redis refuses acks the entry (the worker dead-letters it).
# Then, unless room is -1, up to room (+ the members dropped here) entries move from
# the queue to the in-flight list.  Returns {{status of each message: 0 sent, 1
# refused, 2 cancelled, 3 refused by Redis, 4 lost track}, {claimed...}, whether the
# cancelled set exists}}.
STEP: Final = _HELPERS + f"""
local n, room = tonumber(ARGV[4]), tonumber(ARGV[2])
local claiming = room >= 0
local status = {{}}
for j = 1, n do
  local b, marker, to = 5 + 6 * (j - 1), KEYS[2 + 2 * j], KEYS[3 + 2 * j]
  local seq, final = tonumber(ARGV[b + 1]), ARGV[b + 2] == '1'
  local ours = redis.call('LPOS', KEYS[1], ARGV[b]) ~= false
  local m = ours and redis.pcall('GET', marker) or false
  if type(m) == 'table' then m = 'd' end  -- not a string (WRONGTYPE): never answered
  local expect = streamed(m)  -- (a marker of no number, or a huge one: as expired)
  if expect == nil then
    if m and string.sub(m, 1, 1) == '{_S}' then m = false end
    expect = 0
  end
  local acked = true
  if not ours or m == 'd' then
    status[j] = 1
    acked = ours
  elseif expect ~= seq then
    status[j] = 4
    local fmt = string.sub(ARGV[b], 1, 1) == '{{' and 'json' or 'msgpack'  -- as its entry
    local last = final_error(ARGV[b + 5], m and expect or seq, fmt, 'internal', '{LOST}')
    if not push(to, last, ARGV[1]) then status[j] = 3 end
  elseif not final and cancelled(KEYS[3], ARGV[b + 5]) then
    status[j] = 2
  elseif not push(to, ARGV[b + 4], ARGV[1]) then
    status[j] = 3
  else
    status[j] = 0
    acked = final
    if not final then redis.call('SET', marker, '{_S}' .. (seq + 1), 'PX', ARGV[b + 3]) end
  end
  if acked then
    if status[j] ~= 1 then redis.call('SET', marker, 'd', 'PX', ARGV[b + 3]) end
    redis.call('LREM', KEYS[1], 1, ARGV[b])
  end
  if claiming and status[j] ~= 0 and not final then room = room + 1 end
end
local items = {{}}
if room > 0 then items = redis.call('LPOP', KEYS[2], room) or {{}} end
for i = 1, #items, 1000 do
  redis.call('RPUSH', KEYS[1], unpack(items, i, math.min(i + 999, #items)))
end
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('PEXPIRE', KEYS[1], ARGV[3]) end
return {{status, items, redis.call('EXISTS', KEYS[3])}}
"""

# KEYS[1]=the dead (or returning) worker's inflight  KEYS[2]=queue  KEYS[3]=dead letters
# KEYS[4]=workers zset  KEYS[5]=worker info  KEYS[4+2j]=marker of entry j (j = 1..n)
# KEYS[5+2j]=its reply_to
# ARGV[1]=worker id  ARGV[2]=now ms, or 'force' (a worker returning its own entries)
# ARGV[3]=sha1 hex of the in-flight entries read  ARGV[4]=reply ttl s
# ARGV[5]=dead-letter ttl s  ARGV[6]=nd  ARGV[7..6+nd]=dead letters (unreadable entries)
# ARGV[7+nd]=n, then 7 per entry from b = 8 + nd + 7(j-1): ARGV[b]=the entry to requeue
# ('' when it may not run again)  ARGV[b+1]=its dead letter (the entry's first bytes,
# ``DEAD_LETTER_MAX_BYTES``)  ARGV[b+2]=request id
# ARGV[b+3]='json' or 'msgpack'  ARGV[b+4]=marker ttl ms  ARGV[b+5]=error message
# ARGV[b+6]=error code
# An entry whose marker says chunks went out ('s<n>') is never run again (its chunks
# would repeat): its caller gets a final error message numbered n.  An entry already
# answered ('d') is dropped.  The others go back to the queue's front, in order, or,
# when they may not run again, get a final error message numbered 0 and are
# dead-lettered.  Returns {{requeued, dead-lettered}}, or -1 if the lease is live again,
# -2 if the in-flight list changed since it was read.
REAP: Final = _HELPERS + f"""
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
local function ended(j, b, seq)  -- refused by Redis (WRONGTYPE): none to tell
  push(KEYS[5 + 2 * j], final_error(ARGV[b + 2], seq, ARGV[b + 3], ARGV[b + 6], ARGV[b + 5]),
       ARGV[4])
  redis.call('SET', KEYS[4 + 2 * j], 'd', 'PX', ARGV[b + 4])
end
local requeue = {{}}
for j = 1, n do
  local b = 8 + nd + 7 * (j - 1)
  local m = redis.pcall('GET', KEYS[4 + 2 * j])
  if type(m) == 'table' then m = false end
  if streamed(m) then
    ended(j, b, streamed(m))
  elseif m ~= 'd' then
    if ARGV[b] ~= '' then
      requeue[#requeue + 1] = ARGV[b]
    else
      ended(j, b, 0)
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
return {{#requeue, #dead}}
"""
