-- Take a singleton lock when an execution starts, or say why not.
--
-- KEYS[1] lock    string: the owner record; its TTL is the lease
-- KEYS[2] fence   string: last fencing token granted for this key
-- KEYS[3] fin     string: id of a task that finished while a copy of it waited
-- KEYS[4] done    string: the task whose success keeps the key done (when the
--                 task keeps no done window: left out under scope 'run', the
--                 lock's own key in its place on the other paths, whose KEYS
--                 go by position)
-- KEYS[5] queued  string: the task that took the key when it was sent
--                 (scopes 'queue' and 'queue_and_run' only)
-- (both markers: the task's name, a newline, its id; enqueue.lua, release.lua)
-- ARGV[1] task id          ARGV[2] execution id (unique to this attempt)
-- ARGV[3] lease ms         ARGV[4] the record's fields from 'lease' on
-- ARGV[5] scope, with KEYS[5]: 'run', 'queue' or 'queue_and_run'
-- KEYS[6] throttle string: the task that opened the throttle window: its name, the
--                 window's end (server ms), its id, joined by newlines
--                 (singleton_throttle only; KEYS[5] and ARGV[5] are then passed too)
-- ARGV[6] the throttle window in ms   ARGV[7] the task's name (with KEYS[6])
-- KEYS[7] replaced hash: superseded task id -> the task's name, a newline and
--                 the id of the task that replaced it (enqueue.lua)
--                 (singleton_on_duplicate 'replace' only; KEYS[6] and ARGV[5]
--                 to ARGV[7] are then passed too, ARGV[6] '0' when not throttled)
-- KEYS[8] rate    sorted set: task ids that started within singleton_rate's window,
--                 scored by their start (server ms); with ARGV[8] the starts
--                 allowed in a window, ARGV[9] the window in ms (KEYS[5] to
--                 KEYS[7] and ARGV[5] to ARGV[7] are then passed too, KEYS[7]
--                 the lock's own key when not replacing)
-- ARGV[#ARGV - 2] (after whichever of the above are passed) how long the
--                 fencing counter lives from this grant, ms: the lease and
--                 singleton_fence_ttl (docs/fencing.md#retention)
-- ARGV[#ARGV - 1] the request's deadline, server ms ('0': none): past it, its
--                 caller gave up waiting, and the request does nothing
-- ARGV[#ARGV] (last) when a grant not confirmed by then expires, server ms
--                 ('0': it lives its lease; grant_ttl in the prelude)
--
-- The owner record is one string, fields joined by newlines (docs/redis-keys.md):
--   exec, handoff, copies, token, at, lease, fin, retries, pid, hostkey, host, name, task
-- The task id comes last, so it may hold any character; no other field has a newline.
--
-- Returns
--   token                       granted (a string of digits)
--   {0, record, accepted, ttl}  held by another task (running or queued); ttl: the
--                               lock's remaining ms (a grant not confirmed yet
--                               lives until its deadline: grant_ttl in the prelude)
--   {2, record}                 held by another execution of this task id
--   {3, task}                   this task id already finished
--   {4, task}                   done: another task succeeded within done_ttl
--   {5, task, ms}               throttled: another task started within the window,
--                               which reopens in ms
--   {6, task}                   replaced: a later send took this one's place while
--                               it was queued; that task runs instead
--   {7, task, ms}               rate limited: as many starts as allowed are within
--                               the window ('task': the oldest), which admits
--                               another in ms
--   {8, ms}                     too late: the request arrived after its deadline
--                               (the server clock then, ms); nothing was done
-- accepted = 1: the refused execution took the key when it was sent; it keeps
-- that marker, because a send that was accepted must run (it waits its turn).
local lock, fence, fin, done, queued = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
if done == lock then done = nil end  -- no done window: no marker to look for
local throttle = KEYS[6]
if throttle and ARGV[6] == '0' then throttle = nil end
local replaced = KEYS[7]
if replaced == lock then replaced = nil end
local rate = KEYS[8]
local task_id, exec_id = ARGV[1], ARGV[2]
local fence_ms = ARGV[#ARGV - 2]
local deadline, confirm_by = ARGV[#ARGV - 1], ARGV[#ARGV]

-- The marker this task left when it was sent: the key passes from it to the
-- execution in this same script, so no duplicate slips in between.
local own_queued = false
if queued then
  local marker = redis.call('GET', queued)
  own_queued = marker and (string.match(marker, '\n(.*)$') or marker) == task_id
end

if replaced and not own_queued then
  local by = redis.call('HGET', replaced, task_id)
  -- the id after the name (a record written before names were kept: the id alone)
  if by then return {6, string.match(by, '\n(.*)$') or by} end
end

local record = redis.call('GET', lock)
-- true when this task's retry takes back the key its earlier attempt kept: the
-- checks below are for everyone else, and the grant at the end follows at once
local handed = false
-- the copies mark of the record a retry takes back: a redelivered copy seen
-- by an earlier attempt still waits for the task's finish marker
local kept_copies = ''
-- the task id ends the record: only a record that ends with ours is read field by field
if record and string.sub(record, -#task_id - 1) == '\n' .. task_id then
  -- exec, handoff, copies, then nine fields, then the task id
  local exec, handoff, copies, holder = string.match(record, RECORD_EXEC_HANDOFF_COPIES_TASK)
  if holder == task_id then
    if handoff == string.match(ARGV[4], REST_RETRIES) then
      -- the retried execution takes back the key its earlier attempt kept for it
      handed = true
      kept_copies = copies
    elseif exec == exec_id then
      local t = redis.call('TIME')
      if too_late(deadline, t) then return {8, clock_ms(t)} end
      redis.call('PEXPIRE', lock, ARGV[3])
      return string.match(record, RECORD_TOKEN)
    else
      -- a redelivered copy: the holder must leave a trace when it finishes
      if copies ~= '1' then
        redis.call('SET', lock, with_copies(record, exec, handoff, copies), 'KEEPTTL')
      end
      return {2, record}
    end
  end
end

if not handed then
  local done_by = done and redis.call('GET', done)
  if done_by then
    done_by = string.match(done_by, '\n(.*)$') or done_by  -- the id after the name
    if own_queued then redis.call('DEL', queued) end
    if done_by == task_id then return {3, task_id} end
    return {4, done_by}
  end

  if throttle then
    local window = redis.call('GET', throttle)
    local ends, by
    if window then ends, by = string.match(window, '^[^\n]*\n(%d+)\n(.*)$') end
    if by and by ~= task_id then
      -- another task started within the window: whatever its outcome, this
      -- one does not start before the window reopens (the key's own expiry
      -- may lag its end by a millisecond: at the end, it is open)
      local left = tonumber(ends) - clock_ms(redis.call('TIME'))
      if left > 0 then
        if own_queued then redis.call('DEL', queued) end
        return {5, by, left}
      end
    end
  end

  if rate then
    local full = rate_full(rate, task_id, tonumber(ARGV[8]), tonumber(ARGV[9]))
    if full then
      if own_queued then redis.call('DEL', queued) end
      return full
    end
  end

  if record then
    return {0, record, own_queued and 1 or 0, redis.call('PTTL', lock)}
  end
  if redis.call('GET', fin) == task_id then
    if own_queued then redis.call('DEL', queued) end
    return {3, task_id}
  end
  if ARGV[5] == 'queue_and_run' and not own_queued then
    local other = redis.call('GET', queued)
    if other then
      -- sent while another was queued, past the send-time check (a canvas
      -- member, a plain send_task): the queued one owns the key
      return {0, holder_record(string.match(other, '\n(.*)$') or other), 0}
    end
  end
end

-- Granted: a token, the owner record, and the throttle window if there is one.
local t = redis.call('TIME')
if too_late(deadline, t) then return {8, clock_ms(t)} end
if own_queued and not handed then
  redis.call('DEL', queued)  -- the key passes from the send-time marker to this execution
end
local now = clock_us(t)
local token = grant_token(fence, now, fence_ms)
local granted = new_record(exec_id, token, now, ARGV[4])
if kept_copies == '1' then granted = with_copies(granted, exec_id, '', '') end
redis.call('SET', lock, granted, 'PX', grant_ttl(ARGV[3], confirm_by, t))
if throttle then
  -- a start opens the window; a retry of the task that opened it keeps it
  local ends = string.format('%.0f', math.floor(tonumber(now) / 1000) + tonumber(ARGV[6]))
  redis.call('SET', throttle, ARGV[7] .. '\n' .. ends .. '\n' .. task_id, 'PX', ARGV[6], 'NX')
end
if rate then
  -- a start takes a place in the window (a retry of the same task keeps its own)
  redis.call('ZADD', rate, 'NX', math.floor(tonumber(now) / 1000), task_id)
  redis.call('PEXPIRE', rate, ARGV[9])
end
return token
