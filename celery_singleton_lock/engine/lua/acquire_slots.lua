-- Take one of N slots of a key when an execution starts (singleton_limit = N > 1),
-- or say why not. Each slot is a lock of its own (an owner record, the lease
-- its TTL); all share the key's fencing counter, so tokens of one key only go up.
--
-- KEYS[1] fence   string: last fencing token granted for this key
-- KEYS[2] fin     string: id of a task that finished while a copy of it waited
-- KEYS[3] done    string: the task whose success keeps the key done (the
--                 fence's key in its place when the task keeps no done window)
-- KEYS[4] back    hash: the slots written back since the server forgot the key
--                 (reclaim.lua): while it lives, a free slot missing from it
--                 is not granted (its holder may be about to write it back)
-- KEYS[5..]       the slots' owner records, slot 1 first (slot 1 is the key's
--                 lock of singleton_limit = 1)
-- KEYS[#KEYS]     with ARGV[8]: singleton_rate's sorted set of starts (acquire.lua),
--                 ARGV[8] the starts allowed in a window, ARGV[9] the window in ms
-- ARGV[1] task id          ARGV[2] execution id (unique to this attempt)
-- ARGV[3] lease ms         ARGV[4] the record's fields from 'lease' on
-- ARGV[5] how long the fencing counter lives from this grant, ms (acquire.lua)
-- ARGV[6] the request's deadline, server ms ('0': none; acquire.lua)
-- ARGV[7] when a grant not confirmed by then expires, server ms (acquire.lua)
-- (the owner record's layout is acquire.lua's: docs/redis-keys.md)
--
-- Returns
--   {1, token, slot}            granted slot number 'slot'
--   {0, record, 0, slot, ttl}   every slot held by other tasks ('slot': the first),
--                               or kept for a holder writing it back; ttl: the
--                               shortest remaining ms of the slots held (acquire.lua)
--   {2, record, slot}           held by another execution of this task id
--   {3, task}                   this task id already finished
--   {4, task}                   done: another task succeeded within done_ttl
--   {7, task, ms}               rate limited (acquire.lua)
--   {8, ms}                     too late (acquire.lua): nothing was done
local fence, fin, done, back = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
if done == fence then done = nil end  -- no done window: no marker to look for
local task_id, exec_id = ARGV[1], ARGV[2]
local rate = ARGV[8] and KEYS[#KEYS]
local nslots = #KEYS - 4 - (rate and 1 or 0)
local deadline, confirm_by = ARGV[6], ARGV[7]

-- (copies: the mark of the record a retry takes back, kept: a copy seen by
-- an earlier attempt still waits for the task's finish marker)
local function grant(slot, copies)
  local t = redis.call('TIME')
  if too_late(deadline, t) then return {8, clock_ms(t)} end
  local now = clock_us(t)
  local token = grant_token(fence, now, ARGV[5])
  local granted = new_record(exec_id, token, now, ARGV[4])
  if copies == '1' then granted = with_copies(granted, exec_id, '', '') end
  redis.call('SET', KEYS[4 + slot], granted, 'PX', grant_ttl(ARGV[3], confirm_by, t))
  if rate then
    redis.call('ZADD', rate, 'NX', math.floor(tonumber(now) / 1000), task_id)
    redis.call('PEXPIRE', rate, ARGV[9])
  end
  return {1, token, slot}
end

local records, free = {}, nil
for slot = 1, nslots do
  local record = redis.call('GET', KEYS[4 + slot])
  records[slot] = record
  if not record then
    free = free or slot
  elseif string.sub(record, -#task_id - 1) == '\n' .. task_id then
    local exec, handoff, copies, holder = string.match(record, RECORD_EXEC_HANDOFF_COPIES_TASK)
    if holder == task_id then
      if handoff == string.match(ARGV[4], REST_RETRIES) then
        -- the retry takes back the slot its attempt kept for it
        return grant(slot, copies)
      end
      if exec == exec_id then
        local t = redis.call('TIME')
        if too_late(deadline, t) then return {8, clock_ms(t)} end
        redis.call('PEXPIRE', KEYS[4 + slot], ARGV[3])
        return {1, string.match(record, RECORD_TOKEN), slot}
      end
      if copies ~= '1' then
        redis.call('SET', KEYS[4 + slot], with_copies(record, exec, handoff, copies),
          'KEEPTTL')
      end
      return {2, record, slot}
    end
  end
end

local done_by = done and redis.call('GET', done)
if done_by then
  done_by = string.match(done_by, '\n(.*)$') or done_by
  if done_by == task_id then return {3, task_id} end
  return {4, done_by}
end
if free and rate then
  local full = rate_full(rate, task_id, tonumber(ARGV[8]), tonumber(ARGV[9]))
  if full then return full end
end
if free and redis.call('HGET', back, '') then
  -- the server forgot the key and some of its slots are written back: the
  -- others may be too, by holders still running; none is granted until
  -- 'back' expires (reclaim.lua)
  free = nil
  for slot = 1, nslots do
    if not records[slot] and redis.call('HGET', back, KEYS[4 + slot]) then
      free = slot  -- written back, then released: its holder is done
      break
    end
  end
end
if not free then
  local first, ttl = nil, -1
  for slot = 1, nslots do
    if records[slot] then
      first = first or slot
      local left = redis.call('PTTL', KEYS[4 + slot])
      if ttl < 0 or (left >= 0 and left < ttl) then ttl = left end
    end
  end
  if first then return {0, records[first], 0, first, ttl} end
  return {0, holder_record(''), 0, 1, -1}
end
if redis.call('GET', fin) == task_id then
  return {3, task_id}
end
return grant(free)
