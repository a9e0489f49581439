-- buffer_all (beat): the run before ended; take the oldest waiting tick if
-- nobody sent one since the beat looked (the last tick sent is unchanged).
--
-- KEYS[1] queue  sorted set: the waiting ticks (score = member = tick ms)
-- KEYS[2] last   string: the last tick sent (ms)
-- ARGV[1] the last tick the beat saw ('' for none)   ARGV[2] last's TTL ms
--
-- Returns the tick ms, 0 when another beat took one, -1 when nothing waits
local last = redis.call('GET', KEYS[2]) or ''
if last ~= ARGV[1] then return 0 end
local popped = redis.call('ZPOPMIN', KEYS[1])
if #popped == 0 then return -1 end
redis.call('SET', KEYS[2], popped[1], 'PX', ARGV[2])
return popped[1]
