-- Move a queue's oldest dead letter back onto its queue, in one step: a process that dies
-- midway has either moved it or not touched it. A letter of a campaign fed through a window
-- goes through the campaign's books as an admit does: it becomes open (so it takes a window
-- slot, and a run of the campaign does not send it again) and starts afresh; one already open
-- (a run sent the job again meanwhile) is not pushed a second time.
-- KEYS[1]: the queue's dead letters; KEYS[2]: the list the message goes to; KEYS[3..6]: the
-- job's campaign's open set, counts hash (field window), failed hash and attempts hash
-- ARGV[1]: the letter as stored (it must still be the oldest); ARGV[2]: its message, '' for a
-- cut one (dropped); ARGV[3]: its job id, '' when the letter has no job of a campaign
-- Returns 1 if pushed, 0 if dropped or already open, -1 if the oldest letter is another one.
if redis.call('LINDEX', KEYS[1], -1) ~= ARGV[1] then
  return -1
end
redis.call('RPOP', KEYS[1])
if ARGV[2] == '' then
  return 0
end
local id = ARGV[3]
if id ~= '' and redis.call('HEXISTS', KEYS[4], 'window') == 1 then
  if redis.call('SADD', KEYS[3], id) == 0 then
    return 0
  end
  redis.call('HDEL', KEYS[5], id)
  redis.call('HDEL', KEYS[6], id)
end
redis.call('LPUSH', KEYS[2], ARGV[2])
return 1
