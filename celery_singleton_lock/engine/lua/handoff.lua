-- Keep a lock for the retry of its task: the next attempt takes it back.
--
-- KEYS[1] lock
-- ARGV[1] execution id   ARGV[2] retries of the next attempt   ARGV[3] lease ms
--
-- Returns 1 handed off, 0 not ours
local lock = KEYS[1]
local record = redis.call('GET', lock)
if not record then
  return 0
end
local exec, handoff = string.match(record, RECORD_EXEC_HANDOFF)
if exec ~= ARGV[1] then
  return 0
end
-- the record with its second field, handoff, set
redis.call('SET', lock, exec .. '\n' .. ARGV[2] .. string.sub(record, #exec + #handoff + 2),
  'PX', ARGV[3])
return 1
