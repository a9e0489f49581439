-- Extend every lease one worker process holds, in one call.
--
-- KEYS[i]      lock of the i-th held lock
-- ARGV[2i-1]   its execution id
-- ARGV[2i]     its lease ms
--
-- Returns one integer per key: 1 renewed, 0 held by another execution,
-- 2 handed to a retry, 3 absent (no record at all: a Redis that restarted
-- empty, an eviction; the holder may take it back while its lease is valid)
local out = {}
for i, lock in ipairs(KEYS) do
  local record = redis.call('GET', lock)
  if not record then
    out[i] = 3
  else
    local exec, handoff = string.match(record, RECORD_EXEC_HANDOFF)
    if exec ~= ARGV[2 * i - 1] then
      out[i] = 0
    elseif handoff ~= '' then
      out[i] = 2
    else
      redis.call('PEXPIRE', lock, ARGV[2 * i])
      out[i] = 1
    end
  end
end
return out
