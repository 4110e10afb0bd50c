-- How many of a set's members are fields of a hash: the failed jobs of one submission (its
-- set of job ids, its campaign's failed hash), which `submit --wait` counts every second. Only
-- the count crosses the wire, never the failed jobs' ids or reasons, and Redis walks the
-- smaller of the two, as SINTERCARD walks the smallest of its sets.
-- KEYS[1]: the set; KEYS[2]: the hash
-- ARGV: none
-- Returns the count.
local count = 0
if redis.call('SCARD', KEYS[1]) <= redis.call('HLEN', KEYS[2]) then
  for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
    count = count + redis.call('HEXISTS', KEYS[2], id)
  end
else
  for _, id in ipairs(redis.call('HKEYS', KEYS[2])) do
    count = count + redis.call('SISMEMBER', KEYS[1], id)
  end
end
return count
