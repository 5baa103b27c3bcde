"""Names on the wire between Envoy and this server: headers, metadata namespaces, log names.

One module, so the Envoy configuration we render (`extproc.stack`), the manifests in deploy/
and the server that reads and writes these names can never disagree.
"""

from __future__ import annotations

__all__ = [
    "ACCESS_LOG_NAME",
    "ATTRIBUTE_NAMESPACE",
    "DESTINATION_HEADER",
    "HEADERS_NAMESPACE",
    "HEADER_ATTRIBUTE",
    "LB_NAMESPACE",
    "LEASE_KEY",
    "REPLICA_KEY",
    "REQUEST_NAMESPACE",
    "SUBSET_HINT_KEY",
    "SUBSET_HINT_NAMESPACE",
    "SYNC_SUBJECT_PREFIX",
    "TOKEN_NAMESPACE",
    "USAGE_NAMESPACE",
]

# The Endpoint Picker Protocol: our pick (then fallbacks), as a header and as envoy.lb metadata.
DESTINATION_HEADER = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
SUBSET_HINT_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_HINT_KEY = "x-gateway-destination-endpoint-subset"
# Where Envoy puts the request attributes it sends to an ext_proc server.
ATTRIBUTE_NAMESPACE = "envoy.filters.http.ext_proc"
# One-message routing (request headers skipped): Envoy sends the headers the server reads as
# request attributes on the body message, each under this CEL expression as its key ...
HEADER_ATTRIBUTE = "request.headers['{}']"
# ... and the headers the routing answer sets travel back in this metadata namespace, which a
# Lua filter after the routing filter copies onto the request (Envoy drops a body answer's
# header mutations when it never held the headers).
HEADERS_NAMESPACE = "extproc.headers"
# What the routing decision knew, written by the routing filter (director.api.RoutedRequest).
REQUEST_NAMESPACE = "extproc.request"
# In it, the request's lease: the replica that holds it (host:pid) and its number there; the
# access-log record brings them back to end the lease on whatever process receives it.
REPLICA_KEY = "replica"
LEASE_KEY = "lease"
# The response's usage as read by the Lua filter (extproc/stack/usage.lua).
USAGE_NAMESPACE = "extproc.usage"
# Envoy AI Gateway's token metadata, read by Envoy Gateway's usage-based rate limits.
TOKEN_NAMESPACE = "io.envoy.ai_gateway"
# Replica sync subjects: `<prefix>.<gateway>`; NATS permissions grant `<prefix>.>`.
SYNC_SUBJECT_PREFIX = "extproc.sync"
# The gRPC access log's log_name for accounting records.
ACCESS_LOG_NAME = "extproc-accounting"
