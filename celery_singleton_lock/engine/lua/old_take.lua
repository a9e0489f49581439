-- Take the lock celery-singleton or celery-once keeps for a call, as a
-- SingletonTask starts it while a fleet moves over (singleton_also_lock).
--
-- KEYS[1] the other library's key for the call
-- ARGV[1] this task id (the value celery-singleton writes; ours for celery-once)
-- ARGV[2] lease ms: the key lives as long as ours, renewed with it
-- ARGV[3] '1': a celery-once token (32 hex digits; a task id has dashes) is
--         this message's own: celery-once writes a random token when it sends,
--         so a message it sent cannot be told apart otherwise; '0': any value
--         but ARGV[1] is another call's
--
-- Returns {1, value}: the key is this execution's, holding value;
--         {0, value}: another call's, which holds value
local value = redis.call('GET', KEYS[1])
if not value then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return {1, ARGV[1]}
end
if value == ARGV[1] or (ARGV[3] == '1' and string.len(value) == 32
                        and string.match(value, '^%x+$')) then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, value}
end
return {0, value}
