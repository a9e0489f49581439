-- Release a lock if this execution still owns it.
--
-- KEYS[1] lock   KEYS[2] fin   KEYS[3] done (only when the key stays done)
-- ARGV[1] execution id
-- ARGV[2] '1' (or left out) the task finished: record the finish if a copy
--         was seen (the record holds the task id and the fin TTL); '2' the
--         task finished: record it always (acks_late tasks); '0' not finished
--         (a dead owner being cleared)
-- ARGV[3] task id, ARGV[4] fin TTL ms: with '2', or with KEYS[3]
-- ARGV[5] done TTL ms, ARGV[6] task name, with KEYS[3]
--
-- Returns 1 released, 0 held by another execution, -1 free (no owner record:
-- the lease ran out, or an earlier copy of this very command freed it)
local lock = KEYS[1]
local record = redis.call('GET', lock)
local ours, copies = false, nil
if record then
  local exec
  exec, copies = string.match(record, RECORD_EXEC_COPIES)
  ours = exec == ARGV[1]
end
local mode = ARGV[2] or '1'
if mode == '2' then
  redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[4])
elseif mode == '1' and ours and copies == '1' then
  -- fields 7 (fin TTL) and 13 (task id)
  local fin_ms, task = string.match(record, RECORD_FIN_TASK)
  redis.call('SET', KEYS[2], task, 'PX', fin_ms)
end
if KEYS[3] then
  -- the work is done even if the lease was lost on the way
  -- the task's name, a newline, its id (as the send-time marker, enqueue.lua)
  redis.call('SET', KEYS[3], ARGV[6] .. '\n' .. ARGV[3], 'PX', ARGV[5])
end
if not ours then
  if record then return 0 end
  return -1
end
redis.call('DEL', lock)
return 1
