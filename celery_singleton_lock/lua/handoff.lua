-- Keep a lock for the retry of its task: the next attempt takes it back.
--
-- KEYS[1] lock
-- ARGV[1] execution id   ARGV[2] retries of the next attempt   ARGV[3] lease ms
--
-- Returns 1 handed off, 0 not ours
local lock = KEYS[1]
if redis.call('HGET', lock, 'exec') ~= ARGV[1] then
  return 0
end
redis.call('HSET', lock, 'handoff', ARGV[2])
redis.call('PEXPIRE', lock, ARGV[3])
return 1
