-- Release a lock only while it is still this holder's: compare and delete in one step, so a
-- holder that stalled past the lock's expiry never frees the next holder's lock.
-- KEYS[1]: the lock; ARGV[1]: the holder's token
-- Returns 1 if released, 0 if the lock is another's or gone.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
