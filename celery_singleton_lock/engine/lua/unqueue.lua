-- Free a key taken at send time, if the given task still has it.
--
-- KEYS[1] queued
-- ARGV[1] task id
--
-- Returns 1 freed, 0 not this task's
local marker = redis.call('GET', KEYS[1])
if not marker then return 0 end
-- the task's name, a newline, its id (enqueue.lua)
local i = string.find(marker, '\n', 1, true)
if i then marker = string.sub(marker, i + 1) end
if marker == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
