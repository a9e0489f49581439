-- Write a held lock back when a renewal found its key gone because the
-- server forgot it (restarted empty, flushed, failed over to a replica that
-- never had it), not because someone released it.
--
-- KEYS[1] lock   KEYS[2] fence   KEYS[3] back
-- ARGV[1] execution id   ARGV[2] lease ms   ARGV[3] the holder's token (digits)
-- ARGV[4] the record's fields from 'lease' on, as acquire.lua's ARGV[4]
-- ARGV[5] how long 'back' is kept after a write-back, ms
-- ARGV[6] how long the fencing counter lives from the write-back, ms (acquire.lua)
-- ARGV[7] the request's deadline, server ms ('0': none; acquire.lua)
--
-- The key's fencing counter tells the two apart: every grant and renewal
-- keeps it singleton_fence_ttl past the lease and nothing deletes it, so a
-- lock gone while its counter stays was released (`celery singleton
-- release`) or ran out; a lock gone with its counter was forgotten with
-- everything else.
--
-- The slots of one key (singleton_limit) share that counter, so the first
-- slot written back after the server forgot them recreates it while the
-- others are still to come. 'back' (a hash: each lock key written back since
-- the counter was recreated -> its token; '' -> 1 while it lives) tells them
-- apart: a slot not in it whose counter came back with 'back' was forgotten
-- too, and is written back; a slot in it was written back once already, so
-- its key gone now was released. acquire_slots.lua grants no slot missing
-- from a live 'back': its holder may be about to write it back.
--
-- Returns
--   token         written back, under a new token above the holder's, the
--                 counter's and the clock
--   {1, token}    the key is this execution's already (written back meanwhile): renewed
--   {0, record}   another execution holds the key
--   -1            released or expired (the counter is still there): not written back
--   {8, ms}       too late (acquire.lua): nothing was done
local lock, fence, back = KEYS[1], KEYS[2], KEYS[3]
local exec_id, holder_token = ARGV[1], ARGV[3]
local record = redis.call('GET', lock)
if record then
  local exec, token = string.match(record, RECORD_EXEC_TOKEN)
  if exec == exec_id then
    redis.call('PEXPIRE', lock, ARGV[2])
    return {1, token}
  end
  return {0, record}
end
local last = redis.call('GET', fence)
if last and not (back and redis.call('HGET', back, '') and not redis.call('HGET', back, lock)) then
  return -1
end
local t = redis.call('TIME')
if too_late(ARGV[7], t) then return {8, clock_ms(t)} end
local now = clock_us(t)
-- above the token the holder was granted, the counter and whatever the clock says now
local token = past(past(now, holder_token), last)
redis.call('SET', fence, token, 'PX', ARGV[6])
redis.call('SET', lock, new_record(exec_id, token, now, ARGV[4]), 'PX', ARGV[2])
if back then
  redis.call('HSET', back, '', '1', lock, token)
  redis.call('PEXPIRE', back, ARGV[5])
end
return token
