-- Token usage of an OpenAI-style response, read inside Envoy as the body streams through.
--
-- One copy serves every install: the local stack inlines this file into its bootstrap and
-- deploy/overlays/envoy-gateway ships it in an EnvoyExtensionPolicy (a test keeps them equal).
-- bodyChunks() sees each chunk as it passes and never holds one back, so it adds no latency
-- to the token stream. What it finds goes into dynamic metadata, which Envoy's gRPC access
-- log carries to the ext_proc server in one record per request (docs/architecture.md):
--
--   extproc.usage:        prompt_tokens, completion_tokens, cached_tokens (the engine's
--                         `usage`, the last one seen), events (SSE events carrying content: the
--                         fallback count when there is no usage), first_token_ms (wall clock, ms)
--   io.envoy.ai_gateway:  llm_input_token, llm_output_token, llm_total_token,
--                         llm_cached_input_token (Envoy Gateway's usage-based rate limits)
--
-- Three usage shapes are read (docs/engines.md, APIs): chat / completions (`prompt_tokens`,
-- `completion_tokens`, `cached_tokens`), the Responses API (`input_tokens` with cached ones
-- in it, `output_tokens`, `input_tokens_details.cached_tokens`, in `response.completed`) and
-- Anthropic Messages (`input_tokens` without cache reads or writes, `output_tokens`,
-- `cache_read_input_tokens`, `cache_creation_input_tokens`; `message_start` has the input
-- count, `message_delta` the final output count, maybe alone). All become prompt / completion
-- / cached tokens here, so the access log reads one shape. A usage followed by content in the
-- stream was an opening count (message_start's output 0): its completion count is set to null
-- until the final usage comes, so a stream cut before then is counted from its events.
--
-- A `usage` object is searched in the bytes, never decoded as a whole: model text
-- inside a JSON string has its quotes escaped (\"usage\"), so it cannot forge one.
-- Cost is per chunk, not per stream: each chunk is scanned once, with the last TAIL bytes of
-- the one before (a marker split across two chunks is still found). Only when a usage object
-- starts but does not end in a chunk are its bytes kept until it does (at most PENDING_MAX).
--
-- Tested where it runs: under LuaJIT 2.1, Envoy's runtime, against one table of bodies split at
-- every byte (tests/stack/test_usage_lua.py, tests/usage_vectors.py), and through real Envoy
-- (tests/e2e/test_usage_accounting.py). A bad usage must never raise: the stream goes on.

local TAIL = 64 -- longer than any marker below, so one split across two chunks is found
local PENDING_MAX = 65536
local EVENTS_EVERY = 8 -- publish the event count this often, so an aborted stream keeps it
-- A content event: a chat delta or completions text that is not empty; in a Responses stream
-- (told by its event types) a text / reasoning / arguments delta event. Anthropic's
-- `content_block_delta` events carry `"text":"..."` too.
local CONTENT = { '"content":"[^"]', '"text":"[^"]' }
local RESPONSES_CONTENT = {
  '"type":"response%.output_text%.delta"',
  '"type":"response%.reasoning_text%.delta"',
  '"type":"response%.function_call_arguments%.delta"',
}
local USAGE = '"usage"%s*:%s*{'
-- 2^53: past it a double is no exact count (the server's access-log reader has the same bound).
local MAX_COUNT = 9007199254740992

-- The count after `"key":` in obj, or nil when there is none: a string, a negative, fractional
-- or exponent number, or one past MAX_COUNT is not a count (never 2 for 2.5, never inf).
local function number_after(obj, key)
  local v = string.match(obj, '"' .. key .. '"%s*:%s*(%d+)%s*[,}]')
  if v == nil then
    return nil
  end
  local n = tonumber(v)
  if n > MAX_COUNT then
    return nil
  end
  return n
end

-- Every complete `"usage": {...}` object in s, in order, with where each ends, and where an
-- incomplete one after them starts (nil when none is incomplete).
local function scan_usage(s)
  local complete = {}
  local open_at = nil
  local init = 1
  while true do
    local b, e = string.find(s, USAGE, init)
    if b == nil then
      return complete, open_at
    end
    local obj = string.match(s, "^%b{}", e)
    if obj ~= nil then
      complete[#complete + 1] = { obj = obj, last = e + #obj - 1 }
      open_at = nil
    else
      open_at = b
    end
    init = e + 1
  end
end

-- Publishes one usage object; `state.prompt` keeps the input count an Anthropic
-- `message_start` gave, for a `message_delta` that carries the output count alone.
local function publish_usage(meta, obj, state)
  local prompt = number_after(obj, "prompt_tokens")
  local completion = number_after(obj, "completion_tokens")
  local cached = number_after(obj, "cached_tokens")
  if prompt == nil and completion == nil then
    prompt = number_after(obj, "input_tokens")
    completion = number_after(obj, "output_tokens")
    local read = number_after(obj, "cache_read_input_tokens")
    local write = number_after(obj, "cache_creation_input_tokens")
    if read ~= nil then
      cached = read
    end
    if prompt ~= nil then
      prompt = prompt + (read or 0) + (write or 0)
    end
  end
  if completion == nil then
    return false
  end
  if prompt == nil then
    prompt = state.prompt
  end
  if prompt == nil then
    return false
  end
  state.prompt = prompt
  meta:set("extproc.usage", "prompt_tokens", prompt)
  meta:set("extproc.usage", "completion_tokens", completion)
  meta:set("io.envoy.ai_gateway", "llm_input_token", prompt)
  meta:set("io.envoy.ai_gateway", "llm_output_token", completion)
  meta:set("io.envoy.ai_gateway", "llm_total_token", prompt + completion)
  if cached ~= nil then
    meta:set("extproc.usage", "cached_tokens", cached)
    meta:set("io.envoy.ai_gateway", "llm_cached_input_token", cached)
  end
  return true
end

function envoy_on_response(handle)
  local headers = handle:headers()
  local ctype = headers:get("content-type") or ""
  local sse = string.find(ctype, "text/event-stream", 1, true) ~= nil
  if not sse and string.find(ctype, "json", 1, true) == nil then
    return
  end
  if headers:get("content-encoding") ~= nil then
    return -- compressed bytes: nothing to read; the record says usage is unknown
  end
  -- Envoy objects are valid only until the script yields: fetch the metadata handle anew
  -- after each chunk.
  local function meta()
    return handle:streamInfo():dynamicMetadata()
  end
  local tail = ""
  local pending = nil -- bytes of a usage object that has not ended yet
  local events = 0
  local published = 0
  local first = false
  local state = { prompt = nil }
  local shown = false -- a usage's completion count is in the metadata
  local content = CONTENT
  for chunk in handle:bodyChunks() do
    local bytes = chunk:getBytes(0, chunk:length())
    local s = tail .. bytes
    local skip = #tail -- matches ending inside the tail were counted with the last chunk
    local last_content = 0 -- where the last content match in s ends
    local new_content = false
    if sse then
      if content == CONTENT and string.find(s, '"type":"response.', 1, true) ~= nil then
        content = RESPONSES_CONTENT -- its done events repeat the text: count deltas only
      end
      for _, pattern in ipairs(content) do
        local init = 1
        while true do
          local _, e = string.find(s, pattern, init)
          if e == nil then
            break
          end
          if e > skip then
            events = events + 1
            new_content = true
          end
          if e > last_content then
            last_content = e
          end
          init = e + 1
        end
      end
      if events > 0 and not first then
        first = true
        meta():set("extproc.usage", "first_token_ms", handle:timestamp())
      end
      if events - published >= EVENTS_EVERY then
        published = events
        meta():set("extproc.usage", "events", events)
      end
    end
    local region = nil
    if pending ~= nil then
      region = pending .. bytes
    else
      local at = string.find(s, '"usage"', 1, true)
      if at ~= nil then
        region = string.sub(s, at)
      end
    end
    pending = nil
    local usage_end = nil -- where (in s) the last usage published from this chunk ends
    if region ~= nil then
      local objs, open_at = scan_usage(region)
      for _, found in ipairs(objs) do
        if publish_usage(meta(), found.obj, state) then
          shown = true
          usage_end = found.last + #s - #region -- region is a suffix of s, or ends as s does
        end
      end
      if open_at ~= nil and #region - open_at < PENDING_MAX then
        pending = string.sub(region, open_at)
      end
    end
    -- Content after the last usage: that usage was an opening count (Anthropic's
    -- message_start), not the final one. Withdraw its completion count at once, so a stream
    -- cut before the final usage is counted from its events, never accounted 0 output tokens.
    local after = new_content -- no usage from this chunk: new content follows the last one
    if usage_end ~= nil then
      after = last_content > usage_end
    end
    if shown and after then
      shown = false
      local m = meta()
      m:set("extproc.usage", "completion_tokens", nil)
      m:set("io.envoy.ai_gateway", "llm_output_token", nil)
      m:set("io.envoy.ai_gateway", "llm_total_token", nil)
    end
    if #s > TAIL then
      tail = string.sub(s, -TAIL)
    else
      tail = s
    end
  end
  if sse then
    meta():set("extproc.usage", "events", events)
  end
end
