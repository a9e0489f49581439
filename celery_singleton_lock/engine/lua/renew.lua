-- Extend every lease one worker process holds, in one call, and the fencing
-- counter of each lock's key with it (it outlives the lock: reclaim.lua).
--
-- KEYS[2i-1]   lock of the i-th held lock   KEYS[2i]  its key's fencing counter
-- ARGV[1]      how long a counter outlives its lock, ms (singleton_fence_ttl;
--              at least a tenth of the lease: calls.fence_ttl_ms)
-- ARGV[2i]     the i-th lock's execution id
-- ARGV[2i+1]   its lease ms
--
-- Returns one integer per lock: 1 renewed, 0 held by another execution,
-- 2 handed to a retry, 3 absent (no record at all: a Redis that restarted
-- empty, an eviction; the holder may take it back while its lease is valid)
local out = {}
local keep = tonumber(ARGV[1])
for i = 1, #KEYS / 2 do
  local lock = KEYS[2 * i - 1]
  local record = redis.call('GET', lock)
  if not record then
    out[i] = 3
  else
    local exec, handoff = string.match(record, RECORD_EXEC_HANDOFF)
    if exec ~= ARGV[2 * i] then
      out[i] = 0
    elseif handoff ~= '' then
      out[i] = 2
    else
      local lease = ARGV[2 * i + 1]
      redis.call('PEXPIRE', lock, lease)
      local ms = tonumber(lease)
      redis.call('PEXPIRE', KEYS[2 * i], ms + math.max(keep, math.floor(ms / 10)))
      out[i] = 1
    end
  end
end
return out
