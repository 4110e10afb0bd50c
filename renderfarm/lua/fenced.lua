-- A feeder's write of its campaign's books, only while the feeder lock is still its holder's:
-- compare and write in one step, so a run that stalled past the lock's expiry (another run
-- took the campaign over) never writes over the live run's counts (`{jobs, fed}` that would
-- make status call the campaign finished early) or lifts its cancel. Sets fields of the
-- counts hash, then deletes fields of it and whole keys (the cancel flag and cancelled set).
-- KEYS[1]: the feeder lock; KEYS[2]: the campaign's counts hash; KEYS[3..]: keys to delete
-- ARGV[1]: the holder's token; ARGV[2]: the number of fields to set, N; ARGV[3..2 + 2N]:
-- field, value pairs; the rest: the fields to delete
-- Returns 1 if written, 0 (nothing written) if the lock is another's or gone.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
local pairs_end = 2 + 2 * tonumber(ARGV[2])
for i = 3, pairs_end, 2 do
  redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
end
for i = pairs_end + 1, #ARGV do
  redis.call('HDEL', KEYS[2], ARGV[i])
end
for i = 3, #KEYS do
  redis.call('DEL', KEYS[i])
end
return 1
