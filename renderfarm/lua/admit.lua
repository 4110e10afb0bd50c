#!lua
-- Record a campaign's jobs as open (queued or running) and push their messages, in one
-- atomic step: a feeder that dies or loses Redis has sent a chunk whole or not at all, so
-- every open job has its message (a later run leaves open jobs to the workers and sends the
-- rest). The shebang makes a server out of memory refuse the whole script instead of failing
-- it halfway. It admits nothing for a run that no longer holds the campaign's feeder lock (it
-- stalled past the lock's expiry and another run took over), nor once the campaign is
-- cancelled. It is idempotent: run again with the same admit token (redis-py sends a command
-- again when the connection dropped before its reply came), it does nothing and answers as the
-- first time; and a job already open (sent by another path: a requeued dead letter) is neither
-- pushed nor counted again. A job newly open starts afresh: no stale failure, a full set of
-- attempts.
-- KEYS[1]: the campaign's open set; KEYS[2]: its counts hash (fields submitted, and admit:
-- the last admit's token and how many jobs it opened, TOKEN:N); KEYS[3]: its failed hash; KEYS[4]: its attempts hash; KEYS[5]: its times hash
-- (field first_submitted); KEYS[6]: the set of queue names; KEYS[7]: its feeder lock;
-- KEYS[8]: its cancel flag; KEYS[9]: its refunds hash; KEYS[10..]: the lists the messages go to
-- ARGV: the time, the admit token, the feeder lock's holder token, the number of queue names,
-- the queue names, then per job its id, its list (1 for KEYS[10], 2 for KEYS[11], ...) and its
-- message (each list gets its messages as one LPUSH of them in that order would).
-- Returns {outcome, jobs newly open}: outcome 'ok', 'lock' (not the holder) or 'cancelled'.
local last = redis.call('HGET', KEYS[2], 'admit')
if last then
  local token, opened = string.match(last, '^(.*):(%d+)$')
  if token == ARGV[2] then
    return {'ok', tonumber(opened)}
  end
end
if redis.call('GET', KEYS[7]) ~= ARGV[3] then
  return {'lock', 0}
end
if redis.call('EXISTS', KEYS[8]) == 1 then
  return {'cancelled', 0}
end
local queues = tonumber(ARGV[4])
for i = 5, 4 + queues do
  redis.call('SADD', KEYS[6], ARGV[i])
end
local newly = 0
for i = 5 + queues, #ARGV, 3 do
  local id = ARGV[i]
  if redis.call('SADD', KEYS[1], id) == 1 then
    redis.call('HDEL', KEYS[3], id)
    redis.call('HDEL', KEYS[4], id)
    redis.call('HDEL', KEYS[9], id)
    redis.call('LPUSH', KEYS[9 + tonumber(ARGV[i + 1])], ARGV[i + 2])
    newly = newly + 1
  end
end
redis.call('HINCRBY', KEYS[2], 'submitted', newly)
redis.call('HSET', KEYS[2], 'admit', ARGV[2] .. ':' .. newly)
redis.call('HSETNX', KEYS[5], 'first_submitted', ARGV[1])
return {'ok', newly}
