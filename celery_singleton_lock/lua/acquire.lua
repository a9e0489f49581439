-- Take a singleton lock when an execution starts, or say why not.
--
-- KEYS[1] lock    hash: the owner record; its TTL is the lease
-- KEYS[2] fence   string: last fencing token granted for this key
-- KEYS[3] fin     string: id of a task that finished while a copy of it waited
-- KEYS[4] queued  string: id of the task that took the key when it was sent
-- KEYS[5] done    string: id of the task whose success keeps the key done
-- ARGV[1] task id          ARGV[2] execution id (unique to this attempt)
-- ARGV[3] lease ms         ARGV[4] worker hostname
-- ARGV[5] host key         ARGV[6] pid
-- ARGV[7] retries of the request   ARGV[8] task name
-- ARGV[9] fence counter TTL ms
-- ARGV[10] scope: 'run', 'queue' or 'queue_and_run'
--
-- Returns
--   {1, token}                                      granted
--   {0, task, exec, host key, pid, host, accepted}  held by another task (running or queued)
--   {2, task, exec, host key, pid, host, 0}         held by another execution of this task id
--   {3, task}                                       this task id already finished
--   {4, task}                                       done: another task succeeded within done_ttl
-- accepted = 1: the refused execution took the key when it was sent; it keeps
-- that marker, because a send that was accepted must run (it waits its turn).
local lock, fence, fin, queued, done = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local task_id, exec_id, lease = ARGV[1], ARGV[2], tonumber(ARGV[3])
local retries, scope = ARGV[7], ARGV[10]

local function grant(replace)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  -- Tokens never go down, even when the counter is lost (expired, evicted,
  -- a failover): the server clock in microseconds is their floor. One grant
  -- takes longer than a microsecond, so the counter cannot run ahead of the
  -- clock and a lost counter restarts above every token already given.
  local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local token = tonumber(redis.call('GET', fence) or '0') + 1
  if token < now_us then token = now_us end
  local token_s = string.format('%.0f', token)
  redis.call('SET', fence, token_s, 'PX', ARGV[9])
  if replace then redis.call('DEL', lock) end  -- fields of the record it replaces
  redis.call('HSET', lock, 'task', task_id, 'exec', exec_id, 'host', ARGV[4],
    'hostkey', ARGV[5], 'pid', ARGV[6], 'at', string.format('%.0f', now),
    'token', token_s, 'lease', ARGV[3], 'name', ARGV[8], 'retries', retries)
  redis.call('PEXPIRE', lock, lease)
  return {1, token}
end

-- The marker this task left when it was sent: the key passes from it to the
-- execution in this same script, so no duplicate slips in between.
local own_queued = false
if scope ~= 'run' then
  own_queued = redis.call('GET', queued) == task_id
end

local holder = redis.call('HMGET', lock, 'task', 'exec', 'hostkey', 'pid', 'host', 'handoff')
if holder[1] == task_id then
  if holder[6] == retries then
    -- the retried execution takes back the key its earlier attempt kept for it
    return grant(true)
  end
  if holder[2] == exec_id then
    redis.call('PEXPIRE', lock, lease)
    return {1, tonumber(redis.call('HGET', lock, 'token'))}
  end
  -- a redelivered copy: the holder must leave a trace when it finishes
  redis.call('HSET', lock, 'copies', '1')
  return {2, holder[1], holder[2], holder[3] or '', holder[4] or '', holder[5] or '', 0}
end

local done_by = redis.call('GET', done)
if done_by then
  if own_queued then redis.call('DEL', queued) end
  if done_by == task_id then return {3, task_id} end
  return {4, done_by}
end

if holder[1] then
  return {0, holder[1], holder[2], holder[3] or '', holder[4] or '', holder[5] or '',
    own_queued and 1 or 0}
end
if redis.call('GET', fin) == task_id then
  if own_queued then redis.call('DEL', queued) end
  return {3, task_id}
end
if scope == 'queue_and_run' and not own_queued then
  local other = redis.call('GET', queued)
  if other then
    -- sent while another was queued, past the send-time check (a canvas
    -- member, a plain send_task): the queued one owns the key
    return {0, other, '', '', '0', '', 0}
  end
end
if own_queued then
  redis.call('DEL', queued)
end
return grant()
