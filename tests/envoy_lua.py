"""Runs an Envoy HTTP Lua filter script (extproc/stack/usage.lua) under LuaJIT 2.1, the runtime
Envoy embeds, with the few parts of Envoy's stream-handle API the script calls.

Envoy runs `envoy_on_response(handle)` as a coroutine: `bodyChunks()` yields until the next
body chunk arrives and resumes with it, and ends after the end-of-stream chunk. The shim does
the same, and provides exactly what Envoy's API provides for the calls the script makes
(Envoy's docs, configuration/http/http_filters/lua_filter, and its source,
source/extensions/filters/{http,common}/lua), no more:

- `handle:headers()`: a header object whose `get(key)` is case-insensitive and returns nil for
  an absent header (several values are joined with ",").
- `handle:bodyChunks()`: an iterator of buffer objects, one per chunk as it arrives (a chunk
  may be empty, e.g. the end-of-stream frame), that yields while it waits for the next and
  ends, without yielding, after the end-of-stream chunk (the last one passed here); a
  buffer's `length()`, and `getBytes(index, length)`, which raises unless
  `index, length >= 0` and `index + length <= length()`.
- `handle:streamInfo():dynamicMetadata():set(namespace, key, value)`: merges `key` into the
  namespace's Struct; a number becomes a double (protobuf `number_value`), nil a null value
  (None here; the key stays), a string, boolean or table as Envoy maps them; any other type
  raises.
- `handle:timestamp()`: milliseconds since the epoch (here a fixed value the caller passes).
- Envoy's rule that headers, stream info and body chunks "do not survive any yields"
  (`StreamHandleWrapper::onMarkDead`): using one after the script resumed raises, as Envoy
  does ("object used outside of proper scope").

Envoy catches an error in the script, counts it and lets the response through with whatever
metadata was set before; `run_response` reports it in `LuaRun.error` instead, so a test can
demand none. One `LuaRuntime` serves many responses, as Envoy keeps one Lua state per worker:
state leaking between responses would show.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lupa import luajit21  # type: ignore[import-untyped]

from extproc._pb.envoy.data.accesslog.v3 import accesslog_pb2 as al

__all__ = ["LuaRun", "UsageLua", "access_entry"]

USAGE_LUA = Path(__file__).resolve().parents[1] / "extproc" / "stack" / "usage.lua"

# The shim, in Lua so the script meets Lua objects and a Lua coroutine, as in Envoy.
_SHIM = r"""
local function dead_check(obj)
  if obj._dead then
    error("object used outside of proper scope", 2)
  end
end

local function header_map(list)
  local h = { _dead = false }
  function h:get(key)
    dead_check(self)
    key = string.lower(key)
    local found = nil
    for _, pair in ipairs(list) do
      if string.lower(pair[1]) == key then
        found = found and (found .. "," .. pair[2]) or pair[2]
      end
    end
    return found
  end
  return h
end

local function buffer(bytes)
  local b = { _dead = false }
  function b:length()
    dead_check(self)
    return #bytes
  end
  function b:getBytes(index, length)
    dead_check(self)
    index, length = math.floor(index), math.floor(length)
    if index < 0 or length < 0 or index + length > #bytes then
      error("index/length must be >= 0 and (index + length) must be <= buffer size", 2)
    end
    return string.sub(bytes, index + 1, index + length)
  end
  return b
end

local NULL = {} -- a key set to nil: Envoy stores a null_value, it does not remove the key

local function metadata_value(value)
  local kind = type(value)
  if kind == "nil" then
    return NULL
  end
  if kind == "number" or kind == "string" or kind == "boolean" or kind == "table" then
    return value
  end
  error("unexpected type '" .. kind .. "' in dynamicMetadata", 3)
end

-- Runs envoy_on_response over one response: `headers` a list of {name, value}, `chunks` a
-- list of strings. Returns the metadata ({namespace = {key = value}}) and the script's error.
return function(envoy_on_response, headers, chunks, now_ms, ended)
  local metadata = {}
  local live = {} -- objects that die at the next yield
  local function track(obj)
    live[#live + 1] = obj
    return obj
  end
  local handle = {}
  function handle:headers()
    return track(header_map(headers))
  end
  function handle:timestamp()
    return now_ms
  end
  function handle:streamInfo()
    local info = track({ _dead = false })
    function info:dynamicMetadata()
      dead_check(self)
      local dm = track({ _dead = false })
      function dm:set(namespace, key, value)
        dead_check(self)
        assert(type(namespace) == "string" and type(key) == "string", "string expected")
        metadata[namespace] = metadata[namespace] or {}
        metadata[namespace][key] = metadata_value(value)
      end
      return dm
    end
    return info
  end
  local end_stream = ended and #chunks == 0 -- a response without a body ends with its headers
  function handle:bodyChunks()
    return function()
      if end_stream then
        return nil -- after the end-of-stream chunk Envoy returns at once, without yielding
      end
      for _, obj in ipairs(live) do
        obj._dead = true
      end
      live = {}
      local bytes, last = coroutine.yield()
      end_stream = last
      return track(buffer(bytes))
    end
  end
  local co = coroutine.create(function()
    envoy_on_response(handle)
  end)
  local ok, err = coroutine.resume(co)
  for i = 1, #chunks do
    if not ok or coroutine.status(co) == "dead" then
      break
    end
    ok, err = coroutine.resume(co, chunks[i], ended and i == #chunks)
  end
  if ended and ok and coroutine.status(co) ~= "dead" then
    err = "the script did not finish at the end of the body"
    ok = false
  end
  for _, fields in pairs(metadata) do
    for key, value in pairs(fields) do
      if value == NULL then
        fields[key] = "<null>"
      end
    end
  end
  return metadata, (not ok) and tostring(err) or nil
end
"""


@dataclass(frozen=True, slots=True)
class LuaRun:
    """What one response left: dynamic metadata by namespace (numbers as Envoy stores them,
    doubles) and the script's error, if it raised."""

    metadata: Mapping[str, Mapping[str, object]]
    error: str | None


def _python(value: Any) -> object:
    if value == b"<null>":
        return None
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return float(value)  # Envoy: static_cast<double>(lua_tonumber(...))
    return value


class UsageLua:
    """One Lua state (one Envoy worker) running usage.lua's `envoy_on_response`."""

    def __init__(self, script: Path = USAGE_LUA) -> None:
        self._lua = luajit21.LuaRuntime(encoding=None)
        self._lua.execute(script.read_bytes())
        self._on_response = self._lua.globals().envoy_on_response
        self._run = self._lua.execute(_SHIM.encode())

    @property
    def version(self) -> str:
        """The runtime, as `jit.version` and `_VERSION` say (e.g. "LuaJIT 2.1... / Lua 5.1")."""
        jit, lua = self._lua.eval(b"jit.version"), self._lua.eval(b"_VERSION")
        return f"{jit.decode()} / {lua.decode()}"

    def run_response(
        self,
        chunks: Iterable[bytes],
        headers: Sequence[tuple[str, str]] = (("content-type", "text/event-stream"),),
        now_ms: int = 1_700_000_000_000,
        *,
        ended: bool = True,
    ) -> LuaRun:
        """One response through the script. `ended=False`: the stream is cut after the last
        chunk (a reset: Envoy abandons the coroutine mid-loop, so only what the script set
        before then stays)."""
        table = self._lua.table_from
        header_list = table([table([k.encode(), v.encode()]) for k, v in headers])
        metadata, error = self._run(
            self._on_response, header_list, table(list(chunks)), now_ms, ended
        )
        out = {
            ns.decode(): {k.decode(): _python(v) for k, v in fields.items()}
            for ns, fields in metadata.items()
        }
        return LuaRun(out, None if error is None else error.decode(errors="replace"))


def access_entry(metadata: Mapping[str, Mapping[str, object]]) -> al.HTTPAccessLogEntry:
    """An access-log entry carrying `metadata` as Envoy's gRPC access log sends dynamic
    metadata (a Struct per namespace), for the server's own reader (record_from_entry)."""
    entry = al.HTTPAccessLogEntry()
    entry.response.response_code.value = 200
    for namespace, fields in metadata.items():
        entry.common_properties.metadata.filter_metadata[namespace].update(dict(fields))
    return entry
