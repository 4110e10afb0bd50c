-- Jobs of one campaign go back to their queue, to be tried again: each leaves the running set,
-- and its attempt is refunded (it does not count) or not, in one atomic step per campaign.
-- ARGV[1] says which: 'count' (the attempt counts: the job's failure), 'refund' (it does not:
-- the worker is stopping) or 'bounded' (storage or the broker was away: refunded while the
-- job has had at most ARGV[2] such refunds, then counted, so a failure taken for transient
-- that never ends cannot send a job round for ever). A job with no attempt recorded (never
-- started on its campaign's books) is left alone: nothing is created for it.
-- KEYS[1]: the campaign's running set; KEYS[2]: its attempts hash; KEYS[3]: its refunds hash
-- (job id -> transient failures refunded), which expires with the attempts hash
-- ARGV: the mode, the bound, the seconds both hashes live after their last write, then the job ids
-- Returns, per job, its refunds so far ('bounded'; over the bound: this attempt counted), else 0.
local mode, bound, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local refunds = {}
for i = 4, #ARGV do
  local id = ARGV[i]
  redis.call('SREM', KEYS[1], id)
  local n = 0
  if mode ~= 'count' and redis.call('HEXISTS', KEYS[2], id) == 1 then
    if mode == 'bounded' then
      n = redis.call('HINCRBY', KEYS[3], id, 1)
      redis.call('EXPIRE', KEYS[3], ttl)
    end
    if mode == 'refund' or n <= bound then
      redis.call('HINCRBY', KEYS[2], id, -1)
    end
  end
  refunds[#refunds + 1] = n
end
return refunds
