"""Prefill/decode disaggregation: run the prefill on a prefill pod, return its KV handle.

vLLM's disaggregated serving expects the proxy to send the request to a prefill instance
with `kv_transfer_params.do_remote_decode = true` and max_tokens 1, then to forward the
`kv_transfer_params` of that answer to the decode instance. The gateway does the first call
itself, so the client sends one request and Envoy routes the second to the decode pod.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx
import orjson

from extproc.types import Endpoint

__all__ = ["PrefillClient", "PrefillError"]

_FORWARDED = ("authorization", "x-request-id", "traceparent")


class PrefillError(Exception):
    """The prefill call failed; the request is decoded without remote KV."""


class PrefillClient:
    def __init__(self, client: httpx.AsyncClient, *, timeout_s: float = 30.0) -> None:
        self._client = client
        self._timeout = timeout_s

    async def prefill(
        self, endpoint: Endpoint, path: str, body: Mapping[str, Any], headers: Mapping[str, str]
    ) -> dict[str, Any]:
        payload = dict(body)
        payload.pop("stream_options", None)
        payload.update(
            stream=False,
            max_tokens=1,
            kv_transfer_params={
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
                "remote_host": None,
                "remote_port": None,
            },
        )
        payload.pop("max_completion_tokens", None)
        fwd = {k: v for k, v in headers.items() if k in _FORWARDED}
        fwd["content-type"] = "application/json"
        url = f"http://{endpoint.address}{path.split('?', 1)[0]}"
        try:
            resp = await self._client.post(
                url, content=orjson.dumps(payload), headers=fwd, timeout=self._timeout
            )
        except httpx.HTTPError as exc:
            raise PrefillError(f"{type(exc).__name__}: {exc}") from None
        if resp.status_code != 200:
            raise PrefillError(f"prefill answered {resp.status_code}")
        try:
            params = orjson.loads(resp.content).get("kv_transfer_params")
        except (orjson.JSONDecodeError, AttributeError):
            raise PrefillError("prefill answer is not a JSON object") from None
        if not isinstance(params, dict):
            raise PrefillError("prefill answer carries no kv_transfer_params")
        return params
