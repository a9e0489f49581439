-- Raise a granted lock's fencing counter to a token granted with it elsewhere
-- (Redlock: the quorum's token is the largest any of its masters gave).
--
-- KEYS[1] lock   KEYS[2] fence
-- ARGV[1] execution id   ARGV[2] token (digits)
-- ARGV[3] how long the counter outlives the lock, ms (singleton_fence_ttl)
--
-- Returns 1 when the lock here is this execution's and its counter and owner
-- record now carry at least the token; 0 when it is not (the lease ran out)
local record = redis.call('GET', KEYS[1])
if not record then
  return 0
end
-- exec, handoff, copies, token: the record's first four fields
local exec, handoff, copies, token = string.match(record, RECORD_HEAD)
if exec ~= ARGV[1] then
  return 0
end
local want = ARGV[2]
local last = redis.call('GET', KEYS[2])
if not last or below(last, want) then
  -- it lives as long as the lock, and singleton_fence_ttl after
  redis.call('SET', KEYS[2], want, 'PX', redis.call('PTTL', KEYS[1]) + ARGV[3])
end
if below(token, want) then
  local head = #exec + #handoff + #copies + 3
  redis.call('SET', KEYS[1],
    string.sub(record, 1, head) .. want .. string.sub(record, head + #token + 1), 'KEEPTTL')
end
return 1
