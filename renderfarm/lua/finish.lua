-- Mark a campaign's jobs done and add each newly done job's device-seconds to the campaign's
-- total, atomically: a job finished twice (a redelivery after its result was stored) counts
-- once. A done job is no longer failed or cancelled (one failed for good or skipped, then
-- rendered after all: a requeued dead letter, a duplicate delivery), so it counts once, as
-- done. A campaign fed through a window (its counts hash has a window) keeps no done set:
-- a job is newly done when it leaves the open set, the failed hash or the cancelled set, and
-- the done count goes up; its attempts are forgotten (renderfarm/progress.py's `started`
-- answers NOT_OPEN for such a job delivered again). Any other campaign's job is newly done
-- when it joins the done set, and only if it was submitted: a job not on its campaign's books
-- (a message may name any campaign and job id) creates no key and no field.
-- A newly done job's verdicts count too: the campaign's scores hash has how many done images
-- were safety-checked (field safety) and flagged (nsfw), and how many had a gate (gated) and
-- passed it (passed); and its times hash the first and the last time a job was newly done.
-- KEYS[1]: the campaign's done set; KEYS[2]: its times hash (fields device_seconds,
-- first_done, last_done); KEYS[3]: its open set; KEYS[4]: its counts hash (fields window,
-- done); KEYS[5]: its attempts hash; KEYS[6]: its failed hash; KEYS[7]: its cancelled set;
-- KEYS[8]: its scores hash; KEYS[9]: its submitted set; KEYS[10]: its refunds hash (a done
-- job's transient failures are forgotten)
-- ARGV[1]: the time (unix seconds); then per job its id, its device-seconds and its verdicts:
-- two characters, its safety ('-' not checked, '0' safe, '1' nsfw) and its gate ('-' none,
-- '0' failed, '1' passed)
-- Returns the device-seconds added, as a string (Lua numbers would be cut to integers).
local counted = redis.call('HEXISTS', KEYS[4], 'window') == 1
local added, newly = 0, 0
local checked, flagged, gated, passed = 0, 0, 0, 0
for i = 2, #ARGV, 3 do
  local ended = redis.call('HDEL', KEYS[6], ARGV[i]) + redis.call('SREM', KEYS[7], ARGV[i])
  redis.call('HDEL', KEYS[10], ARGV[i])
  local new = 0
  if counted then
    new = redis.call('SREM', KEYS[3], ARGV[i]) + ended
    redis.call('HDEL', KEYS[5], ARGV[i])
  elseif redis.call('SISMEMBER', KEYS[9], ARGV[i]) == 1 then
    new = redis.call('SADD', KEYS[1], ARGV[i])
  end
  if new > 0 then
    added = added + tonumber(ARGV[i + 1])
    newly = newly + 1
    local safety, gate = string.sub(ARGV[i + 2], 1, 1), string.sub(ARGV[i + 2], 2, 2)
    if safety ~= '-' then
      checked = checked + 1
      flagged = flagged + tonumber(safety)
    end
    if gate ~= '-' then
      gated = gated + 1
      passed = passed + tonumber(gate)
    end
  end
end
if checked > 0 then
  redis.call('HINCRBY', KEYS[8], 'safety', checked)
  redis.call('HINCRBY', KEYS[8], 'nsfw', flagged)
end
if gated > 0 then
  redis.call('HINCRBY', KEYS[8], 'gated', gated)
  redis.call('HINCRBY', KEYS[8], 'passed', passed)
end
if added > 0 then
  redis.call('HINCRBYFLOAT', KEYS[2], 'device_seconds', added)
end
if newly > 0 then
  redis.call('HSETNX', KEYS[2], 'first_done', ARGV[1])
  redis.call('HSET', KEYS[2], 'last_done', ARGV[1])
end
if counted and newly > 0 then
  redis.call('HINCRBY', KEYS[4], 'done', newly)
end
return tostring(added)
