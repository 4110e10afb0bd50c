-- Renew a lock only while it is still this holder's: compare and expire in one step, so a
-- holder that stalled past the lock's expiry never extends the next holder's lock.
-- KEYS[1]: the lock; ARGV[1]: the holder's token; ARGV[2]: seconds it lasts from now
-- Returns 1 if renewed, 0 if the lock is another's or gone.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('EXPIRE', KEYS[1], ARGV[2])
end
return 0
