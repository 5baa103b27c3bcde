"""Running the local stack: Envoy bootstrap rendering (`extproc.stack.envoy_config`).

Submodules are imported explicitly (no re-exports here) so that
`python -m extproc.stack.envoy_config` runs without a double import.
"""

from __future__ import annotations

__all__: list[str] = []
