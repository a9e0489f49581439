-- Release a lock if this execution still owns it.
--
-- KEYS[1] lock   KEYS[2] fin   KEYS[3] done
-- ARGV[1] execution id   ARGV[2] task id
-- ARGV[3] '1' when the task finished (not for a dead owner being cleared)
-- ARGV[4] fin TTL ms
-- ARGV[5] '1' to record the finish even when no copy was seen (acks_late tasks)
-- ARGV[6] done TTL ms when the task succeeded and the key stays done, else 0
--
-- Returns 1 released, 0 held by another execution, -1 free (no owner record:
-- the lease ran out, or an earlier copy of this very command freed it)
local lock, fin, done = KEYS[1], KEYS[2], KEYS[3]
local rec = redis.call('HMGET', lock, 'exec', 'copies')
local ours = rec[1] == ARGV[1]
if ARGV[3] == '1' and ((ours and rec[2]) or ARGV[5] == '1') then
  redis.call('SET', fin, ARGV[2], 'PX', ARGV[4])
end
if tonumber(ARGV[6]) > 0 then
  -- the work is done even if the lease was lost on the way
  redis.call('SET', done, ARGV[2], 'PX', ARGV[6])
end
if not ours then
  if rec[1] then return 0 end
  return -1
end
redis.call('DEL', lock)
return 1
