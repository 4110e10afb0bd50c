#!lua
-- Pop up to ARGV[2] messages from a queue's priority lists and record each one as
-- unacknowledged, in kombu's own format, in the same atomic step (worker/broker.py).
-- KEYS: the priority lists in consuming order, then the unacked index and hash.
-- ARGV: the time to record (the client's: kombu's restore compares it with its own clock;
-- the end of the wait the script ran behind, worker/broker.py),
-- the most messages to pop, then the queue of each priority list (ARGV[2 + i] for KEYS[i]).
-- Returns {list, item, tag} triples; tag is '' for an item that
-- is not a kombu message (not recorded), and else a tag of this delivery's own: the message's
-- delivery tag and the pop's server time. A message restored to its queue and popped again is
-- delivered under another tag, so a late acknowledgement or requeue of its last delivery (a
-- worker that lost its connection, or whose message a restore took) finds no record, instead
-- of taking the new holder's: an acknowledgement would drop it, a requeue would push the
-- message a second time. No message overwrites another's record either (a pushed message
-- chooses its own tag). The record keeps the item's bytes, own tag included: a restored
-- message is checked again when popped again. Its route
-- is the queue it was popped from (exchange '', routing key the queue: kombu's restore puts
-- it back on that queue's list of its priority), never the exchange and routing key the
-- message names, which could send it to a list no worker consumes.
-- The shebang makes a server out of memory refuse the whole script instead of failing it
-- after a pop.
local index, unacked = KEYS[#KEYS - 1], KEYS[#KEYS]
local now, limit = ARGV[1], tonumber(ARGV[2])

-- The delivery tag of a kombu message (one whose delivery_info kombu's restore can mark
-- redelivered), else nil.
local function delivery_tag(item)
  local ok, payload = pcall(cjson.decode, item)
  if not ok or type(payload) ~= 'table' or type(payload.properties) ~= 'table' then return end
  local properties = payload.properties
  if type(properties.delivery_tag) == 'string' and type(properties.delivery_info) == 'table' then
    return properties.delivery_tag
  end
end

-- TAG#SECONDS.MICROSECONDS.N: the server's clock makes the first one free but for the
-- messages of this same pop, which N tells apart.
local function free(tag)
  local time, n, fresh = redis.call('TIME'), 0, nil
  repeat
    n = n + 1
    fresh = tag .. '#' .. time[1] .. '.' .. time[2] .. '.' .. n
  until redis.call('HEXISTS', unacked, fresh) == 0
  return fresh
end

local popped = {}
for i = 1, #KEYS - 2 do
  local left = limit - #popped
  if left <= 0 then break end
  local route = ',"",' .. cjson.encode(ARGV[2 + i]) .. ']'
  for _, item in ipairs(redis.call('RPOP', KEYS[i], left) or {}) do
    local tag = delivery_tag(item)
    if tag then
      tag = free(tag)
      redis.call('ZADD', index, now, tag)
      -- kombu's record, [payload, exchange, routing_key], around the payload's own bytes
      redis.call('HSET', unacked, tag, '[' .. item .. route)
    end
    popped[#popped + 1] = {KEYS[i], item, tag or ''}
  end
end
return popped
