-- Free a key taken at send time, if the given task still has it.
--
-- KEYS[1] queued
-- ARGV[1] task id
--
-- Returns 1 freed, 0 not this task's
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
