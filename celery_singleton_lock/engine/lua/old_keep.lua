-- Renew (or delete) the other library's lock, if it is still this call's.
--
-- KEYS[1] the other library's key for the call
-- ARGV[1] the value it holds for this call (the task id, or the token adopted)
-- ARGV[2] ms to keep it; '0' deletes it
--
-- Returns 1 done, 0 the key holds another value or is gone
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
if ARGV[2] == '0' then
  return redis.call('DEL', KEYS[1])
end
return redis.call('PEXPIRE', KEYS[1], ARGV[2])
