-- buffer_all (beat): a tick arrives. Sent at once only when nothing waits and
-- nobody sent another tick since the beat looked.
--
-- KEYS[1] queue  sorted set: the waiting ticks (score = member = tick ms)
-- KEYS[2] last   string: the last tick sent (ms)
-- ARGV[1] the tick ms   ARGV[2] the last tick the beat saw ('' for none)
-- ARGV[3] '1' when the run before it had ended   ARGV[4] the cap
-- ARGV[5] the queue's TTL ms   ARGV[6] last's TTL ms
--
-- Returns 'send', 'buffered' (it waits, or already did) or 'full'
local last = redis.call('GET', KEYS[2]) or ''
local waiting = redis.call('ZCARD', KEYS[1])
if ARGV[3] == '1' and last == ARGV[2] and waiting == 0 then
  redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[6])
  return 'send'
end
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 'buffered' end
if waiting >= tonumber(ARGV[4]) then return 'full' end
redis.call('ZADD', KEYS[1], ARGV[1], ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return 'buffered'
