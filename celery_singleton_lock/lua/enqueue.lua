-- Take a key when a task is sent (scopes 'queue' and 'queue_and_run').
--
-- KEYS[1] queued  KEYS[2] lock  KEYS[3] done
-- ARGV[1] task id   ARGV[2] scope   ARGV[3] marker TTL ms   ARGV[4] task name
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
--   {0, task}    queued as that task
--   {0, task, 1} running as that task (queue_and_run)
--   {4, task}    done: that task succeeded within done_ttl
local queued, lock, done = KEYS[1], KEYS[2], KEYS[3]
local task_id = ARGV[1]

local done_by = redis.call('GET', done)
if done_by then
  return {4, (string.match(done_by, '\n(.*)$') or done_by)}
end
local other = redis.call('GET', queued)
if other then
  return {0, (string.match(other, '\n(.*)$') or other)}
end
if ARGV[2] == 'queue_and_run' then
  local record = redis.call('GET', lock)
  if record then
    -- the owner record's last field, after twelve others (docs/redis-keys.md)
    return {0, string.match(record, '^' .. string.rep('[^\n]*\n', 12) .. '(.*)$'), 1}
  end
end
redis.call('SET', queued, ARGV[4] .. '\n' .. task_id, 'PX', ARGV[3])
return {1}
