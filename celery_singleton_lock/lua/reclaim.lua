-- Write a held lock back when a renewal found its key gone because the
-- server forgot it (restarted empty, flushed, failed over to a replica that
-- never had it), not because someone released it.
--
-- KEYS[1] lock   KEYS[2] fence
-- ARGV[1] execution id   ARGV[2] lease ms   ARGV[3] the holder's token (digits)
-- ARGV[4] the record's fields from 'lease' on, as acquire.lua's ARGV[4]
--
-- The key's fencing counter tells the two apart: every grant sets it for a
-- day and nothing deletes it, so a lock gone while its counter stays was
-- released (`celery singleton release`) or ran out; a lock gone with its
-- counter was forgotten with everything else.
--
-- Returns
--   token         written back, under a new token above the holder's and the clock
--   {1, token}    the key is this execution's already (written back meanwhile): renewed
--   {0, record}   another execution holds the key
--   -1            released or expired (the counter is still there): not written back
local lock, fence = KEYS[1], KEYS[2]
local exec_id, holder_token = ARGV[1], ARGV[3]
local record = redis.call('GET', lock)
if record then
  local exec, token = string.match(record, '^([^\n]*)\n[^\n]*\n[^\n]*\n([^\n]*)\n')
  if exec == exec_id then
    redis.call('PEXPIRE', lock, ARGV[2])
    return {1, token}
  end
  return {0, record}
end
if redis.call('GET', fence) then
  return -1
end
local t = redis.call('TIME')
local us = t[2]
local now = t[1] .. string.sub('00000', #us) .. us
-- above the token the holder was granted, whatever the clock says now
local token = now
if #holder_token > #now or (#holder_token == #now and holder_token >= now) then
  token = string.format('%.0f', tonumber(holder_token) + 1)
end
redis.call('SET', fence, token, 'PX', '86400000')
redis.call('SET', lock, exec_id .. '\n\n\n' .. token .. '\n' .. now .. '\n' .. ARGV[4],
  'PX', ARGV[2])
return token
