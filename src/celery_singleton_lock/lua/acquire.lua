-- Take a singleton lock, or say who holds it.
--
-- KEYS[1] lock   hash: the owner record; its TTL is the lease
-- KEYS[2] fence  string: last fencing token granted for this key
-- KEYS[3] fin    string: id of a task that finished while a copy of it waited
-- ARGV[1] task id          ARGV[2] execution id (unique to this attempt)
-- ARGV[3] lease ms         ARGV[4] worker hostname
-- ARGV[5] host key         ARGV[6] pid
-- ARGV[7] retries of the request   ARGV[8] task name
-- ARGV[9] fence counter TTL ms
--
-- Returns
--   {1, token}                               granted
--   {0, task, exec, host key, pid, host}     held by another task
--   {2, task, exec, host key, pid, host}     held by another execution of this same task id
--   {3, task}                                this task id already finished
local lock, fence, fin = KEYS[1], KEYS[2], KEYS[3]
local task_id, exec_id, lease = ARGV[1], ARGV[2], tonumber(ARGV[3])
local retries = ARGV[7]

local function grant()
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  -- Tokens never go down, even after the counter expired: the server clock is
  -- their floor, the counter breaks ties within one millisecond.
  local token = tonumber(redis.call('GET', fence) or '0') + 1
  if token < now then token = now end
  local token_s = string.format('%.0f', token)
  redis.call('SET', fence, token_s, 'PX', ARGV[9])
  redis.call('DEL', lock)
  redis.call('HSET', lock, 'task', task_id, 'exec', exec_id, 'host', ARGV[4],
    'hostkey', ARGV[5], 'pid', ARGV[6], 'at', string.format('%.0f', now),
    'token', token_s, 'lease', ARGV[3], 'name', ARGV[8], 'retries', retries)
  redis.call('PEXPIRE', lock, lease)
  return {1, token}
end

local holder = redis.call('HMGET', lock, 'task', 'exec', 'hostkey', 'pid', 'host', 'handoff')
if not holder[1] then
  if redis.call('GET', fin) == task_id then
    return {3, task_id}
  end
  return grant()
end

if holder[1] == task_id then
  if holder[6] == retries then
    -- the retried execution takes back the key its earlier attempt kept for it
    return grant()
  end
  if holder[2] == exec_id then
    redis.call('PEXPIRE', lock, lease)
    return {1, tonumber(redis.call('HGET', lock, 'token'))}
  end
  -- a redelivered copy: the holder must leave a trace when it finishes
  redis.call('HSET', lock, 'copies', '1')
  return {2, holder[1], holder[2], holder[3] or '', holder[4] or '', holder[5] or ''}
end
return {0, holder[1], holder[2], holder[3] or '', holder[4] or '', holder[5] or ''}
