"""Lua scripts for every multi-key step, so each one is atomic in Redis.

Constants come from ``redbatch.protocol`` (formatted in), so the scripts and the
Python side cannot disagree.
"""

from __future__ import annotations

from typing import Final

from redbatch import protocol


# The push loop the enqueue scripts share: entry i's marker is KEYS[k + i], its TTL
# ARGV[t + i], the entry ARGV[t + n + i]; ``room`` entries fit.  An entry whose marker
# exists (a retried push) counts as accepted but is not pushed again.
def _push_loop(k: str, t: str) -> str:
    return f"""local accepted, pushed = 0, 0
for i = 1, n do
  if redis.call('SET', KEYS[{k} + i], 'q', 'NX', 'PX', ARGV[{t} + i]) then
    if room <= 0 then
      redis.call('DEL', KEYS[{k} + i])
      break
    end
    redis.call('RPUSH', KEYS[1], ARGV[{t} + n + i])
    room = room - 1
    pushed = pushed + 1
  end
  accepted = accepted + 1
end
"""


# The refusal of an enqueue into a closed sub-queue (a drained version's: the closed
# marker is the script's last key): {0, -1[, -1]}, nothing pushed.
def _closed_check(depths: int) -> str:
    return ("if redis.call('EXISTS', KEYS[#KEYS]) == 1 then return {0" + ", -1" * depths
            + "} end\n")


# KEYS[1]=queue  KEYS[1+i]=marker of entry i
# ARGV[1]=cap  ARGV[2]=queue ttl ms  ARGV[2+i]=marker ttl ms of entry i  ARGV[2+n+i]=entry i
# Pushes entries in order while the queue is under its cap.  An entry whose marker
# already exists (a retried push) is not pushed again but counts as accepted.
# Returns {how many entries, in order, were accepted; the queue's length after}.
# ENQUEUE_OPEN (a versioned name's): one more key last, the sub-queue's closed marker.
def _enqueue(closed: bool) -> str:
    return (_closed_check(1) if closed else "") + f"""
local n = #KEYS - {2 if closed else 1}
local depth = redis.call('LLEN', KEYS[1])
local room = tonumber(ARGV[1]) - depth
""" + _push_loop("1", "2") + """if pushed > 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return {accepted, depth + pushed}
"""


ENQUEUE: Final = _enqueue(closed=False)
ENQUEUE_OPEN: Final = _enqueue(closed=True)

# KEYS[1]=queue  KEYS[2]=inflight  ARGV[1]=max count  ARGV[2]=inflight ttl ms.
# Moves up to ARGV[1] entries from the queue's head to the in-flight list's tail.
CLAIM: Final = """
local n = tonumber(ARGV[1])
local items = {}
if n > 0 then
  items = redis.call('LPOP', KEYS[1], n) or {}
end
for i = 1, #items, 1000 do  -- in slices: Lua's unpack has a stack limit
  redis.call('RPUSH', KEYS[2], unpack(items, i, math.min(i + 999, #items)))
end
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
end
return items
"""

# KEYS[1]=level queue  KEYS[2]=bell  KEYS[3..2+a]=the queues of the more urgent levels
# KEYS[2+a+i]=marker of entry i
# ARGV[1]=cap of the entries queued at this level and above  ARGV[2]=this level's own cap
# ARGV[3]=queue ttl ms  ARGV[4]=a  ARGV[4+i]=marker ttl ms of entry i  ARGV[4+n+i]=entry i
# ENQUEUE for one priority level of a multi-level model: pushes in order while both caps
# leave room, and rings the bell (a list of one element) if it pushed any.
# Returns {how many entries, in order, were accepted; entries queued at this level and
# above after; entries at this level after}.
# ENQUEUE_LEVEL_OPEN (a versioned name's): one more key last, the closed marker.
def _enqueue_level(closed: bool) -> str:
    return (_closed_check(2) if closed else "") + f"""
local a = tonumber(ARGV[4])
local n = #KEYS - 2 - a{" - 1" if closed else ""}
local ahead = 0
for i = 3, 2 + a do ahead = ahead + redis.call('LLEN', KEYS[i]) end
local own = redis.call('LLEN', KEYS[1])
local room = math.min(tonumber(ARGV[1]) - ahead - own, tonumber(ARGV[2]) - own)
""" + _push_loop("2 + a", "4") + """if pushed > 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  if redis.call('EXISTS', KEYS[2]) == 0 then redis.call('RPUSH', KEYS[2], 1) end
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
end
own = own + pushed
return {accepted, ahead + own, own}
"""


ENQUEUE_LEVEL: Final = _enqueue_level(closed=False)
ENQUEUE_LEVEL_OPEN: Final = _enqueue_level(closed=True)

# KEYS[1]=the closed marker of a draining version's sub-queue  KEYS[2..]=its queues, and
# the in-flight and held lists of it of every worker the version registered (live or not)
# ARGV[1]=marker ttl ms.
# Closes the sub-queue (sets the marker: ENQUEUE_OPEN refuses from then on) if, and only
# if, every list is empty: nothing queued, nothing in flight or held over, not even a
# dead worker's that its reaper has yet to requeue.  Returns 1 if closed, else 0.
DRAIN_CLOSE: Final = """
for i = 2, #KEYS do
  if redis.call('LLEN', KEYS[i]) > 0 then return 0 end
end
redis.call('SET', KEYS[1], 1, 'PX', ARGV[1])
return 1
"""

# KEYS[1]=bell  KEYS[2]=inflight  KEYS[3..]=the level queues, most urgent first
# ARGV[1]=max count  ARGV[2]=inflight ttl ms  ARGV[3]=slots reserved for the levels
# below the most urgent non-empty one  ARGV[4]=rotation (which of those comes first)
# CLAIM for a multi-level model: the reserved slots go one entry at a time to the
# non-empty lower levels in turn (so none of them starves), the rest in priority order;
# the entries move to the in-flight list's tail, in the order returned.  Silences the
# bell (DEL) once every level queue is empty.
# Returns {entries taken from below the most urgent non-empty level, entries left in
# the level queues, {entries...}, the next claim's rotation (ARGV[4] moved on by the
# reserved slots given, so that each lower level gets its turn whatever the claims'
# rhythm)}.
CLAIM_LEVELS: Final = """
local n, reserve, rot = tonumber(ARGV[1]), tonumber(ARGV[3]), tonumber(ARGV[4])
local levels = #KEYS - 2
local lens, top = {}, nil
for l = 1, levels do
  lens[l] = redis.call('LLEN', KEYS[2 + l])
  if top == nil and lens[l] > 0 then top = l end
end
local items, low, k, given = {}, 0, 0, 0
local function take(l, count)
  local got = redis.call('LPOP', KEYS[2 + l], count) or {}
  for i = 1, #got do items[#items + 1] = got[i] end
  lens[l] = lens[l] - #got
  if top ~= nil and l > top then low = low + #got end
  return #got
end
if top ~= nil then
  local lower = {}
  for l = top + 1, levels do if lens[l] > 0 then lower[#lower + 1] = l end end
  while reserve > 0 and #items < n and #lower > 0 do
    local at = (rot + k) % #lower + 1
    take(lower[at], 1)
    if lens[lower[at]] == 0 then table.remove(lower, at) else k = k + 1 end
    reserve, given = reserve - 1, given + 1
  end
  for l = top, levels do
    if #items >= n then break end
    if lens[l] > 0 then take(l, n - #items) end
  end
end
for i = 1, #items, 1000 do  -- in slices: Lua's unpack has a stack limit
  redis.call('RPUSH', KEYS[2], unpack(items, i, math.min(i + 999, #items)))
end
if #items > 0 then redis.call('PEXPIRE', KEYS[2], ARGV[2]) end
local left = 0
for l = 1, levels do left = left + lens[l] end
if left == 0 then redis.call('DEL', KEYS[1]) end
return {low, left, items, rot + given}
"""

# Shared helpers: answer a request at most once (its marker turns to 'd' with the
# first reply), and append entries to a capped dead-letter list.  A command that Redis
# refuses because of one request's keys (someone SET its reply_to as a string: WRONGTYPE)
# fails that request alone: ``redis.pcall``, never an error that would abort the script
# and leave its batch to be retried, unchanged, for ever.  Out of memory still aborts.
# The replies' and dead letters' ARGV start at t: ARGV[t]=dead-letter ttl s  ARGV[t+1]=nd
# ARGV[t+2..t+1+nd]=dead letters, then pairs (marker ttl ms, reply); their keys are pairs
# (marker, reply_to) from KEYS[k].
_HELPERS: Final = f"""
local function refused(r)
  if type(r) == 'table' and r.err then
    if string.sub(r.err, 1, 3) == 'OOM' then error(r) end
    return true
  end
  return false
end

-- Appends the replies of indices js (0-based, in order) to the list ``to``: one RPUSH
-- (per 1000: Lua's unpack has a stack limit); false if Redis refused it (WRONGTYPE).
local function push_replies(to, js, base)
  local data = {{}}
  for i = 1, #js do data[i] = ARGV[base + 2 * js[i] + 2] end
  for i = 1, #data, 1000 do
    if refused(redis.pcall('RPUSH', to, unpack(data, i, math.min(i + 999, #data)))) then
      return false
    end
  end
  return true
end

-- Keeps the list ``to`` for reply_ttl_s at least, and as long as the furthest marker
-- TTL (its request's deadline) of its new replies js: never shortens a longer TTL.
local function keep(to, js, base, reply_ttl_s)
  local ttl_s = tonumber(reply_ttl_s)
  for i = 1, #js do
    ttl_s = math.max(ttl_s, math.ceil(tonumber(ARGV[base + 2 * js[i] + 1]) / 1000))
  end
  if redis.call('EXPIRE', to, ttl_s, 'NX') == 0 then  -- a new list: set (1)
    redis.call('EXPIRE', to, ttl_s, 'GT')  -- else only ever longer
  end
end

-- Sends the replies: each request's marker turns to 'd' (a request whose marker was 'd'
-- already was answered: no second reply), then the new replies go out grouped by reply
-- list, one RPUSH (in batch order) and one TTL (``keep``) per list.  A marker or list Redis
-- refuses fails its own requests alone.
-- Returns {{sent, index of each reply Redis refused (1-based, ascending)...}}.
local function replies(t, k, reply_ttl_s)
  local base = t + 1 + tonumber(ARGV[t + 1])
  local out, bad, lists, order = {{0}}, {{}}, {{}}, {{}}
  for j = 0, (#KEYS - k + 1) / 2 - 1 do
    local prev = redis.pcall('SET', KEYS[k + 2 * j], 'd', 'PX', ARGV[base + 2 * j + 1], 'GET')
    if refused(prev) then
      bad[#bad + 1] = j + 1
    elseif prev ~= 'd' then
      local to = KEYS[k + 1 + 2 * j]
      if lists[to] == nil then lists[to], order[#order + 1] = {{}}, to end
      lists[to][#lists[to] + 1] = j
    end
  end
  for _, to in ipairs(order) do
    local js = lists[to]
    if push_replies(to, js, base) then
      keep(to, js, base, reply_ttl_s)
      out[1] = out[1] + #js
    else
      for i = 1, #js do bad[#bad + 1] = js[i] + 1 end
    end
  end
  table.sort(bad)
  for i = 1, #bad do out[#out + 1] = bad[i] end
  return out
end

-- The SHA-1 of a list's entries; where the server lacks redis.sha1hex (the fakeredis
-- demo fallback), the caller's own digest (ARGV[3]): the takeover check then passes.
local function digest(entries)
  if redis.sha1hex == nil then return ARGV[3] end
  return redis.sha1hex(table.concat(entries))
end

-- Whether the list ``key`` starts with the n entries ARGV[base + 1..base + n]: compared
-- by Redis in place (LPOS), none of the list read into Lua, entry i must be the r-th
-- of its value among the list's first i, r counting its copies among entries 1..i.
-- The worker sends entries only while its user may run LPOS (checked once, at its
-- first claim); should the user lose that right later, or the server not know LPOS,
-- the script compares a copy of the head instead.  Any other error (WRONGTYPE, a bad
-- argument) is raised: nothing is written.
local function copied_starts_with(key, n, base)
  local head = redis.call('LRANGE', key, 0, n - 1)
  if #head ~= n then return false end
  for i = 1, n do
    if head[i] ~= ARGV[base + i] then return false end
  end
  return true
end

-- An error of a command that the user may not run (NOPERM; "can't run this command"
-- from a script on Redis 7.0), or that the server does not know.
local function denied(err)
  local e = string.lower(err)
  for _, text in ipairs({{'noperm', "can't run this command", 'unknown command',
                         'unknown redis command'}}) do
    if string.find(e, text, 1, true) then return true end
  end
  return false
end

local function starts_with(key, n, base)
  local seen = {{}}
  for i = 1, n do
    local entry = ARGV[base + i]
    seen[entry] = (seen[entry] or 0) + 1
    local at = redis.pcall('LPOS', key, entry, 'RANK', seen[entry], 'MAXLEN', i)
    if type(at) == 'table' and at.err then
      if not denied(at.err) then error(at) end
      return copied_starts_with(key, n, base)
    end
    if at ~= i - 1 then return false end
  end
  return true
end

local function dead_letters(key, t)
  local nd = tonumber(ARGV[t + 1])
  if nd == 0 then return end
  for i = t + 2, t + 1 + nd do
    if refused(redis.pcall('RPUSH', key, ARGV[i])) then return end
  end
  redis.call('LTRIM', key, -{protocol.DEAD_LETTER_MAX}, -1)
  redis.call('EXPIRE', key, ARGV[t])
end
"""

# KEYS[1]=inflight  KEYS[2]=dead letters  KEYS[1+2j]=marker j  KEYS[2+2j]=reply_to j
# ARGV[1]=n: entries to ack (from the in-flight head)  ARGV[2]=reply ttl s
# ARGV[3]=sha1 hex of those entries, concatenated, then the replies and dead letters
# (t=4, see _HELPERS); or ARGV[3]=ACK_BY_ENTRIES, ARGV[4..3+n]=the entries themselves
# (compared in place: no copy of the list into Lua, no SHA-1), then the replies and dead
# letters (t=4+n).  The worker passes exactly n entries there (fewer would be a Lua
# error on a nil, before any write).  Replies (each at most once), dead letters and the
# ack, in one step.  The ack trims the batch off the in-flight head only if the head
# still holds exactly the batch: a reaper that took over this worker's list (its lease
# had lapsed) changes it, and then nothing is trimmed and nothing dead-lettered (the
# reaper does that).
# Returns {1 (acked) or 0 (refused), replies sent, indices of refused replies}.
PUBLISH: Final = _HELPERS + f"""
local n, t = tonumber(ARGV[1]), 4
local acked = n == 0
if ARGV[3] == '{protocol.ACK_BY_ENTRIES}' then
  t = 4 + n
  acked = acked or starts_with(KEYS[1], n, 3)
else
  acked = acked or digest(redis.call('LRANGE', KEYS[1], 0, n - 1)) == ARGV[3]
end
local out = replies(t, 3, ARGV[2])
table.insert(out, 1, acked and 1 or 0)
if not acked then return out end
dead_letters(KEYS[2], t)
if n > 0 then redis.call('LTRIM', KEYS[1], n, -1) end
return out
"""

# KEYS[1]=inflight  KEYS[2]=dead letters  KEYS[3]=held  KEYS[2+2j]=marker j
# KEYS[3+2j]=reply_to j
# ARGV[1]=entries to ack (from the in-flight head)  ARGV[2]=reply ttl s
# ARGV[3]=sha1 hex of those entries  ARGV[4]=m: entries held by the batch before, to
# trim off the held list's head  ARGV[5]=sha1 hex of those  ARGV[6]=held ttl ms
# ARGV[7]=h  ARGV[8..7+h]=positions (1-based) among the acked entries of those this
# batch holds over  ARGV[8+h..]=replies and dead letters (t=8+h, see _HELPERS).
# PUBLISH of a batch that holds entries over for the next one, or releases those the
# batch before held (``hold``): as PUBLISH, and, in the same step, the held entries
# move from the in-flight head to the held list's tail (by position: the script has
# them), and the previous ones are trimmed off the held list's head, guarded by their
# digest as the ack is.  Returns as PUBLISH.
PUBLISH_HOLD: Final = _HELPERS + """
local n, m, h = tonumber(ARGV[1]), tonumber(ARGV[4]), tonumber(ARGV[7])
local function same(entries, want)
  return redis.sha1hex == nil or redis.sha1hex(table.concat(entries)) == want
end
local batch = {}
if n > 0 then batch = redis.call('LRANGE', KEYS[1], 0, n - 1) end
local acked = (n == 0 or same(batch, ARGV[3]))
  and (m == 0 or same(redis.call('LRANGE', KEYS[3], 0, m - 1), ARGV[5]))
local out = replies(8 + h, 4, ARGV[2])
table.insert(out, 1, acked and 1 or 0)
if not acked then return out end
dead_letters(KEYS[2], 8 + h)
if m > 0 then redis.call('LTRIM', KEYS[3], m, -1) end
for i = 8, 7 + h do redis.call('RPUSH', KEYS[3], batch[tonumber(ARGV[i])]) end
if h > 0 then redis.call('PEXPIRE', KEYS[3], ARGV[6]) end
if n > 0 then redis.call('LTRIM', KEYS[1], n, -1) end
return out
"""

# KEYS[1]=the dead worker's inflight  KEYS[2]=queue  KEYS[3]=dead letters
# KEYS[4]=workers zset  KEYS[5]=worker info hash  KEYS[6]=its crashing key
# KEYS[7]=the bell (a multi-level model: KEYS[2] is its most urgent level's queue), or
# KEYS[2] again (one level: no bell)  KEYS[8]=its held list  KEYS[7+2j]=marker j
# KEYS[8+2j]=reply_to j
# ARGV[1]=worker id  ARGV[2]=now ms, or 'force' (a worker returning its own batch)
# ARGV[3]=sha1 hex of the held then the in-flight entries the caller read (concatenated)
# ARGV[4]=reply ttl s  ARGV[5]=nq  ARGV[6..5+nq]=entries to requeue, in queue order
# then the dead letters and the replies to their callers (t=6+nq, see _HELPERS).
# Returns nq, or -1 if the lease is live again, -2 if either list changed since.
REAP: Final = _HELPERS + f"""
if ARGV[2] ~= 'force' then
  local lease = redis.call('ZSCORE', KEYS[4], ARGV[1])
  if lease and tonumber(lease) > tonumber(ARGV[2]) then return -1 end
end
local held = redis.call('LRANGE', KEYS[8], 0, -1)
for _, entry in ipairs(redis.call('LRANGE', KEYS[1], 0, -1)) do held[#held + 1] = entry end
if digest(held) ~= ARGV[3] then
  return -2
end
local nq = tonumber(ARGV[5])
for i = 5 + nq, 6, -1 do
  redis.call('LPUSH', KEYS[2], ARGV[i])
end
if nq > 0 then
  redis.call('PEXPIRE', KEYS[2], {protocol.QUEUE_TTL_S * 1000})
  if KEYS[7] ~= KEYS[2] then  -- ring the bell, and keep it as long as the queue
    if redis.call('EXISTS', KEYS[7]) == 0 then redis.call('RPUSH', KEYS[7], 1) end
    redis.call('PEXPIRE', KEYS[7], {protocol.QUEUE_TTL_S * 1000})
  end
end
replies(6 + nq, 9, ARGV[4])
dead_letters(KEYS[3], 6 + nq)
redis.call('DEL', KEYS[1], KEYS[6], KEYS[8])
if ARGV[2] ~= 'force' then
  redis.call('ZREM', KEYS[4], ARGV[1])
  redis.call('HDEL', KEYS[5], ARGV[1])
end
return nq
"""

# Shared by the summaries: the decoded compact capacity field of every worker whose
# lease is live (KEYS[1]=workers zset, KEYS[2]=capacity hash, ARGV[1]=now ms), read
# with one HMGET per 1000 workers; a missing or unreadable field is an empty table.
_LIVE_CAPACITIES: Final = """
local function live_capacities()
  local ids = redis.call('ZRANGEBYSCORE', KEYS[1], ARGV[1], '+inf')
  local caps = {}
  for s = 1, #ids, 1000 do  -- in slices: Lua's unpack has a stack limit
    local raws = redis.call('HMGET', KEYS[2], unpack(ids, s, math.min(s + 999, #ids)))
    for j = 1, #raws do
      local ok, cap = pcall(cjson.decode, raws[j] or '')
      caps[s + j - 1] = (ok and type(cap) == 'table') and cap or {}
    end
  end
  return caps
end
"""

# KEYS[1]=workers zset  KEYS[2]=worker capacity hash  KEYS[3]=meta  KEYS[4]=config hash
# KEYS[5]=versions hash (the model's routing table, HGETALL: empty when unversioned)
# ARGV[1]=now ms.
# A model's live workers as admission needs them, in one read-only round trip that
# never touches the (large) worker_info hash: the workers whose lease is live, the sum
# of their published items_per_s, whether each publishes rows = true, and whether the
# model is known (a worker is live, or its meta exists).  A missing or unreadable
# capacity field counts as 0 items/s and no rows.
# The meta's ``priority`` section (a multi-level model's levels, default and caps),
# re-encoded, or "" when it has none (one level: its meta is not decoded).
# The model's sub-queues: its stored ``sub_queues`` override, else the first
# ``"sub_queues":<n>`` of its meta (its own value, without an override), else 1; a meta
# that never mentions ``sub_queues`` (workers that predate it) means 1, whatever the
# override says, so that no request goes to a sub-queue no worker serves.
# The model's own queue cap: its meta's ``limits.max_queue_len`` in effect (an integer,
# in any order among the fields of the first ``"limits"`` object), else 0 (none).
# Stored live changes of ``priority_caps`` (a list of one cap per level) and
# ``max_queue_len`` take the place of the meta's values at once, as ``sub_queues``'s
# does: the workers republish their meta with them only at their next heartbeat.
# Returns {live, items/s summed (a string: Lua numbers reply as integers), rows 1|0,
# known 1|0, priority JSON or "", sub-queues, the versions table's fields and values,
# the queue cap or 0}.
LIVE_SUMMARY: Final = _LIVE_CAPACITIES + f"""
local caps = live_capacities()
local total, rows = 0, #caps > 0
for i = 1, #caps do
  local rate = tonumber(caps[i]['{protocol.F_ITEMS_PER_S}'])
  if rate and rate > 0 then total = total + rate end
  rows = rows and caps[i]['{protocol.F_ROWS}'] == true
end
local raw = redis.call('GET', KEYS[3])
local known = #caps > 0 or raw ~= false
local stored = raw and redis.call('HMGET', KEYS[4], 'sub_queues', 'priority_caps',
                                  'max_queue_len') or {{}}
local levels = ''
if raw and string.find(raw, '"priority"', 1, true) then
  local ok, meta = pcall(cjson.decode, raw)
  if ok and type(meta) == 'table' and type(meta['priority']) == 'table' then
    local section = meta['priority']
    if stored[2] then  -- caps changed live: in effect here before workers republish
      local fine, live = pcall(cjson.decode, stored[2])
      fine = fine and type(live) == 'table' and #live == tonumber(section['levels'])
      for i = 1, fine and #live or 0 do  -- one cap >= 1 per level (else: the meta's)
        if type(live[i]) ~= 'number' or live[i] < 1 then fine = false end
      end
      if fine then section['caps'] = live end
    end
    levels = cjson.encode(section)
  end
end
local subs = raw and string.match(raw, '"sub_queues":(%d+)')
if subs then subs = stored[1] or subs end
local lim = raw and string.match(raw, '"limits":%s*(%b{{}})')
local cap = lim and string.match(lim, '"max_queue_len":%s*(%d+)%s*[,}}]')
if stored[3] and string.match(stored[3], '^%d+$') then cap = stored[3] end
return {{#caps, tostring(total), rows and 1 or 0, known and 1 or 0, levels, subs or 1,
        redis.call('HGETALL', KEYS[5]), cap or 0}}
"""

# KEYS[1]=versions hash (the model's routing table)
# ARGV[1]=n  ARGV[2..1+2n]=the hash's fields and values as the caller read them
# ARGV[2+2n]=the pinned latest to store ('' deletes it)  ARGV[3+2n..]=fields and values
# An operator's change, stored only if the table is still what the caller read (a
# compare-and-set: the caller reads, checks and edits, then retries on a 0), so that
# two changes at once never lose each other's writes.  Reads with HGETALL and HMGET
# only (the documented least-privilege user has no HGET or HLEN).  Returns 1 if
# stored, else 0.
CHANGE_VERSIONS: Final = f"""
local n = tonumber(ARGV[1])
if #redis.call('HGETALL', KEYS[1]) ~= 2 * n then return 0 end
for i = 2, 2 * n, 2 do
  if redis.call('HMGET', KEYS[1], ARGV[i])[1] ~= ARGV[i + 1] then return 0 end
end
if #ARGV > 2 + 2 * n then redis.call('HSET', KEYS[1], unpack(ARGV, 3 + 2 * n)) end
if ARGV[2 + 2 * n] == '' then
  redis.call('HDEL', KEYS[1], '{protocol.LATEST_FIELD}')
else
  redis.call('HSET', KEYS[1], '{protocol.LATEST_FIELD}', ARGV[2 + 2 * n])
end
return 1
"""

# KEYS[1]=versions hash (the model's routing table)  KEYS[2]=the model's own workers zset
# (its workers served without versions; the same slot, ``{model}``)
# ARGV[1]=version  ARGV[2]=now ms  ARGV[3]=a row of weight null  ARGV[4]=a row of weight 0
# ARGV[5]=the settle, ms.
# A worker registers its version, in one step that merges with the stored table: a
# version already in the table keeps its row (an operator's weight stays).  A row
# marked "base" (an operator's change stored the workers served without versions as
# version "1") stays theirs while any of them is live (the worker reads a canary row
# back: it never drains by their flag).  A real version "1" marks it with "heir": 0
# while they are live (version "1" waits to take it over: a table without them routes
# "1" to it), the time it first saw none live, else.  Once none was live for the
# settle, it takes the row over: the marks dropped, the weight kept, not draining.  Each
# mark is written once, as it changes.  A new version gets weight 0 (requests that pin
# it only, until an operator promotes it) while the model is served already, by another
# version not draining or by live workers without versions, else no weight.  Returns
# the row.
REGISTER_VERSION: Final = """
local row = redis.call('HMGET', KEYS[1], ARGV[1])[1]
if row and not string.find(row, '"base"', 1, true) then return row end
local serving = redis.call('ZCOUNT', KEYS[2], ARGV[2], '+inf') > 0
if row then
  local ok, r = pcall(cjson.decode, row)
  if not (ok and type(r) == 'table' and r['base'] == true) then return row end
  local since = tonumber(r['heir'])
  local now = tonumber(ARGV[2])
  if serving or not since or since == 0 then
    local mark = serving and 0 or now
    if since ~= mark then
      r['heir'] = mark
      redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(r))
    end
    return ARGV[4]
  end
  if now - since < tonumber(ARGV[5]) then return ARGV[4] end
  r['base'] = nil
  r['heir'] = nil
  r['draining'] = false
  row = cjson.encode(r)
  redis.call('HSET', KEYS[1], ARGV[1], row)
  return row
end
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  if not serving and string.sub(all[i], 1, 1) ~= '@' then
    local ok, r = pcall(cjson.decode, all[i + 1])
    serving = not (ok and type(r) == 'table' and (r['draining'] == true or r['base'] == true))
  end
end
row = serving and ARGV[4] or ARGV[3]
redis.call('HSET', KEYS[1], ARGV[1], row)
return row
"""

# KEYS[1]=the model's sub_queues_draining key  ARGV[1]=the sub-queues a worker still
# claims from, above the model's shrunk count  ARGV[2]=ttl ms.
# A draining worker's beat: the key holds the most any drainer claims from, so that two
# drainers of different counts never lower each other's (a larger count lasts while any
# worker drains: it counts only queues that may hold entries).  Returns nothing.
PUBLISH_DRAINING: Final = """
local held = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
redis.call('SET', KEYS[1], math.max(held, tonumber(ARGV[1])), 'PX', ARGV[2])
"""

# KEYS[1]=the model's sub_queues_shrunk notice  KEYS[2]=its sub_queues_draining count
# ARGV[1]=the sub-queues that may hold entries  ARGV[2]=now ms  ARGV[3]=ttl s
# ARGV[4]=the most sub-queues a model may have.
# A shrink notice (``knobs.notice_shrink``): both keys to the most of ARGV[1] and what
# they hold (a notice reads ``<S>:<ms>``), the notice with a new time (every worker
# drains by it once more).  Returns that S.
NOTICE_SHRINK: Final = """
local function count(raw)
  return tonumber(string.match(raw or '', '^(%d+)') or '0') or 0
end
local high = math.max(tonumber(ARGV[1]), count(redis.call('GET', KEYS[1])),
                      count(redis.call('GET', KEYS[2])))
high = math.min(high, tonumber(ARGV[4]))
redis.call('SET', KEYS[1], high .. ':' .. ARGV[2], 'EX', ARGV[3])
redis.call('SET', KEYS[2], high, 'EX', ARGV[3])
return high
"""

# KEYS[1]=workers zset  KEYS[2]=worker capacity hash  ARGV[1]=now ms.
# What the autoscaling gauges need of a model's live workers (read at scrape time, never
# on the request path), read-only: how many hold a live lease, the sum of their
# published items_per_s and how many published one above 0 (the workers that measured
# their capacity), and the sum of their served_per_s.  A missing or unreadable field
# counts as 0.  Returns {live, measured, items/s summed, served/s summed} (sums as
# strings: Lua numbers reply as integers).
SCALING_SUMMARY: Final = _LIVE_CAPACITIES + f"""
local caps = live_capacities()
local capacity, measured, served = 0, 0, 0
for i = 1, #caps do
  local rate = tonumber(caps[i]['{protocol.F_ITEMS_PER_S}'])
  if rate and rate > 0 then capacity, measured = capacity + rate, measured + 1 end
  local done = tonumber(caps[i]['{protocol.F_SERVED_PER_S}'])
  if done and done > 0 then served = served + done end
end
return {{#caps, measured, tostring(capacity), tostring(served)}}
"""

PRODUCER_SCRIPTS: Final = (ENQUEUE, ENQUEUE_LEVEL, ENQUEUE_OPEN, ENQUEUE_LEVEL_OPEN,
                           LIVE_SUMMARY)  # loaded when a Client starts

# --- pipelines (docs/protocol.md §17) ------------------------------------------------
# KEYS[1]=the stage's request marker  KEYS[2]=the request's context at the stage
# KEYS[3]=the stage's queue (of the request's level)  KEYS[4]=the bell (multi-level only)
# KEYS[5..]=(multi-level) the queues of the more urgent levels
# ARGV[1]=marker and context ttl ms  ARGV[2]=context  ARGV[3]=entry  ARGV[4]=queue ttl ms
# ARGV[5]=the stage's cap, of the entries at this level and above (0 or absent: none)
# ARGV[6]=this level's own cap (0 or absent: none)  ARGV[7]='1': the last key is the
# stage's closed marker (a version's stage: refused once its drain closed it)
# A pipeline request enters a stage: deduplicated by its marker, so that a hand-off sent
# again (its sender died before it could mark it done) is not queued twice; refused
# (nothing written) while the caps leave no room, as ENQUEUE_LEVEL's.  Returns 1 if it
# was queued, 0 if it was there already, -2 if its level's cap refused it, -1 if the
# stage's cap did, -3 if the stage is closed.
HANDOFF_SEND: Final = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local last = #KEYS
if ARGV[7] == '1' then
  if redis.call('EXISTS', KEYS[last]) == 1 then return -3 end
  last = last - 1
end
local cap, level_cap = tonumber(ARGV[5] or '0'), tonumber(ARGV[6] or '0')
local own = redis.call('LLEN', KEYS[3])
if level_cap > 0 and own >= level_cap then return -2 end
if cap > 0 then
  for i = 5, last do own = own + redis.call('LLEN', KEYS[i]) end
  if own >= cap then return -1 end
end
redis.call('SET', KEYS[1], 'q', 'PX', ARGV[1])
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[1])
redis.call('RPUSH', KEYS[3], ARGV[3])
redis.call('PEXPIRE', KEYS[3], ARGV[4])
if last >= 4 then
  if redis.call('EXISTS', KEYS[4]) == 0 then redis.call('RPUSH', KEYS[4], 1) end
  redis.call('PEXPIRE', KEYS[4], ARGV[4])
end
return 1
"""

# KEYS[1]=the pipeline's request marker  KEYS[2]=the caller's reply list
# ARGV[1]=marker ttl ms  ARGV[2]=reply  ARGV[3]=reply list ttl s
# A pipeline's final reply, at most once per request id (first writer wins, as PUBLISH).
# Returns 1 if it was sent, 0 if the request had been answered already.
HANDOFF_DELIVER: Final = """
if redis.call('GET', KEYS[1]) == 'd' then return 0 end
redis.call('SET', KEYS[1], 'd', 'PX', ARGV[1])
redis.call('RPUSH', KEYS[2], ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[3])
return 1
"""

# KEYS[1]=a stage's outbox  KEYS[2]=its hand-off set
# ARGV[1]=max records  ARGV[2]=now (epoch ms)  ARGV[3]=lease ms
# Takes hand-off records under a lease: first those whose lease expired (their taker
# died), then new ones from the outbox's head.  Returns the records, then the names of
# the keys it deleted: a key of another type of value (no record can be read from it,
# and it would fail every take, and every reply pushed to the outbox, for good).
HANDOFF_TAKE: Final = f"""
local n, now = tonumber(ARGV[1]), tonumber(ARGV[2])
local dropped = {{}}
local function read(key, ...)  -- a key of another type is deleted (then read as empty)
  local reply = redis.pcall(...)
  if type(reply) == 'table' and reply['err'] then
    if not string.find(reply['err'], 'WRONGTYPE', 1, true) then error(reply) end
    redis.call('DEL', key)
    dropped[#dropped + 1] = key
    return {{}}
  end
  return reply
end
local items = read(KEYS[2], 'ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, n)
if #items < n then
  local fresh = read(KEYS[1], 'LPOP', KEYS[1], n - #items) or {{}}
  for i = 1, #fresh do items[#items + 1] = fresh[i] end
end
for i = 1, #items do redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), items[i]) end
if #items > 0 then redis.call('EXPIRE', KEYS[2], {protocol.INFLIGHT_TTL_S}) end
return {{items, dropped}}
"""

# KEYS[1]=a stage's hand-off set  KEYS[1+i]=record i's context at the stage
# ARGV[i]=record i.  The records were handed on: drop them and their contexts.
HANDOFF_DONE: Final = """
for i = 1, #ARGV do
  redis.call('ZREM', KEYS[1], ARGV[i])
  redis.call('DEL', KEYS[1 + i])
end
return #ARGV
"""

# KEYS[1]=a merge stage's parts of one request  ARGV[1]=branch stage  ARGV[2]=its output
# ARGV[3]=branches of the fan-out  ARGV[4]=ttl ms
# One branch's output, kept once (a part sent again changes nothing).  Returns every
# part (HGETALL) once all branches are in, else an empty list.
HANDOFF_PART: Final = """
redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
if redis.call('HLEN', KEYS[1]) < tonumber(ARGV[3]) then return {} end
return redis.call('HGETALL', KEYS[1])
"""

# KEYS[1]=a merge stage's parts of one request.  Its merge input was sent (the send goes
# first, in the same write): the parts are dropped.
HANDOFF_FORGET: Final = """
return redis.call('DEL', KEYS[1])
"""
