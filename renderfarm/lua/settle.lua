-- A job that ends without being done, failed for good (ARGV[2] 'failed', with its reason) or
-- skipped because its campaign was cancelled ('cancelled'), atomically: it leaves the running
-- and open sets and the other of the two, so it counts once, in the state it ends in. A job
-- already done stays done (a duplicate delivery failed or skipped after another stored it):
-- a campaign fed through a window keeps no done set, so there a job that was neither open,
-- failed nor cancelled is taken as done, and its attempts are forgotten whatever it ends as.
-- A job is recorded cancelled only while the cancel stands: a worker that read the flag
-- before a run lifted it changes nothing, and puts the job back on its queue. A job not on
-- its campaign's books (a message may name any campaign and job id) creates no key and no
-- field: one never submitted to a campaign not fed through a window is taken as done too (a
-- counted campaign's is, above: neither open, failed nor cancelled).
-- KEYS[1]: the campaign's running set; KEYS[2]: its open set; KEYS[3]: its done set;
-- KEYS[4]: its failed hash; KEYS[5]: its cancelled set; KEYS[6]: its counts hash (field
-- window); KEYS[7]: its attempts hash; KEYS[8]: its cancel flag; KEYS[9]: its submitted set;
-- KEYS[10]: its refunds hash (an ended job's transient failures are forgotten)
-- ARGV: job id, 'failed' or 'cancelled', reason
-- Returns 1 if the job was recorded so, 0 if it is done (or not on the books), -1 if the
-- cancel was lifted.
local id = ARGV[1]
if ARGV[2] == 'cancelled' and redis.call('EXISTS', KEYS[8]) == 0 then
  return -1
end
local counted = redis.call('HEXISTS', KEYS[6], 'window') == 1
if not counted and redis.call('SISMEMBER', KEYS[9], id) == 0 then
  return 0
end
redis.call('SREM', KEYS[1], id)
redis.call('HDEL', KEYS[10], id)
local was = redis.call('HDEL', KEYS[4], id) + redis.call('SREM', KEYS[5], id)
local done
if counted then
  redis.call('HDEL', KEYS[7], id)
  done = redis.call('SREM', KEYS[2], id) + was == 0
else
  done = redis.call('SISMEMBER', KEYS[3], id) == 1
end
if done then
  return 0
end
if ARGV[2] == 'failed' then
  redis.call('HSET', KEYS[4], id, ARGV[3])
else
  redis.call('SADD', KEYS[5], id)
end
return 1
