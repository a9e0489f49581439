-- Raise a granted lock's fencing counter to a token granted with it elsewhere
-- (Redlock: the quorum's token is the largest any of its masters gave).
--
-- KEYS[1] lock   KEYS[2] fence
-- ARGV[1] execution id   ARGV[2] token   ARGV[3] fence counter TTL ms
--
-- Returns 1 when the lock here is this execution's and its counter and owner
-- record now carry at least the token; 0 when it is not (the lease ran out)
if redis.call('HGET', KEYS[1], 'exec') ~= ARGV[1] then return 0 end
local token = tonumber(ARGV[2])
if tonumber(redis.call('GET', KEYS[2]) or '0') < token then
  redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
end
if tonumber(redis.call('HGET', KEYS[1], 'token') or '0') < token then
  redis.call('HSET', KEYS[1], 'token', ARGV[2])
end
return 1
