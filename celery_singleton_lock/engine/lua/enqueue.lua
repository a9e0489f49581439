-- Take a key when a task is sent (scopes 'queue' and 'queue_and_run').
--
-- KEYS[1] queued  KEYS[2] lock  KEYS[3] done (the lock's key in its place when
-- the task keeps no done window: no marker to look for)
-- ARGV[1] task id   ARGV[2] scope   ARGV[3] marker TTL ms   ARGV[4] task name
-- With singleton_on_duplicate 'replace' only:
-- KEYS[4] replaced  hash: superseded task id -> the task's name, a newline and
--                   the id of the one that replaced it;
--                   field '' -> when the burst's first send took the key (ms)
-- ARGV[5] debounce ms (0: off)   ARGV[6] debounce_max ms (0: off)
-- ARGV[#ARGV] (last) the request's deadline, server ms ('0': none; acquire.lua)
--
-- The send-time and done markers hold the task's name, a newline, its id
-- (names have no newline; an id may hold any character).
--
-- A task's own retries and waits never come here; a send that reuses the id of
-- the queued or running task (a caller's idempotency key as task id) is a
-- duplicate like any other.
--
-- Returns
--   {1}          taken: send the message
--   {1, ms}      taken, debounced: send it with that countdown
--   {0, task}    queued as that task
--   {0, task, 1} running as that task (queue_and_run)
--   {4, task}    done: that task succeeded within done_ttl
--   {2, task, ms, task}  replaced: that task was queued and had not started;
--                the key is this send's now (send it with countdown ms when
--                debounced); that task is superseded by this send
--   {8, ms}      too late (acquire.lua): nothing was done
local queued, lock, done, replaced = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
if done == lock then done = nil end
local task_id = ARGV[1]

local deadline = ARGV[#ARGV]
local function now_ms()
  return clock_ms(redis.call('TIME'))
end

local done_by = done and redis.call('GET', done)
if done_by then
  return {4, (string.match(done_by, '\n(.*)$') or done_by)}
end
local other = redis.call('GET', queued)
if other then
  local holder = string.match(other, '\n(.*)$') or other
  -- replaced only while still queued: no owner record of it (it has not started)
  local record = replaced and holder ~= task_id and redis.call('GET', lock)
  if replaced and holder ~= task_id and not (
      record and string.sub(record, -#holder - 1) == '\n' .. holder) then
    local t = redis.call('TIME')
    if too_late(deadline, t) then return {8, clock_ms(t)} end
    local now = clock_ms(t)
    -- the superseded call names this one, the call that took its place (the
    -- ones it had replaced keep naming it: each send costs the same however
    -- long the burst)
    redis.call('HSET', replaced, holder, ARGV[4] .. '\n' .. task_id)
    -- the hash outlives every superseded message: as long as the longest marker
    local keep = math.max(tonumber(ARGV[3]), redis.call('PTTL', queued),
      redis.call('PTTL', replaced))
    redis.call('SET', queued, ARGV[4] .. '\n' .. task_id, 'PX', ARGV[3])
    redis.call('PEXPIRE', replaced, keep)
    local wait = tonumber(ARGV[5])
    local cap = tonumber(ARGV[6])
    if wait > 0 and cap > 0 then
      local first = tonumber(redis.call('HGET', replaced, '') or now)
      wait = math.max(0, math.min(wait, first + cap - now))
    end
    return {2, holder, wait, holder}
  end
  return {0, holder}
end
if ARGV[2] == 'queue_and_run' then
  local record = redis.call('GET', lock)
  if record then
    -- the owner record's last field, after twelve others (docs/redis-keys.md)
    return {0, string.match(record, RECORD_TASK), 1}
  end
end
if tonumber(deadline) > 0 then
  local t = redis.call('TIME')
  if too_late(deadline, t) then return {8, clock_ms(t)} end
end
redis.call('SET', queued, ARGV[4] .. '\n' .. task_id, 'PX', ARGV[3])
if replaced and tonumber(ARGV[5]) > 0 then
  -- a burst starts: its cap counts from now
  redis.call('HSET', replaced, '', now_ms())
  redis.call('PEXPIRE', replaced, math.max(tonumber(ARGV[3]), redis.call('PTTL', replaced)))
  return {1, tonumber(ARGV[5])}
end
return {1}
