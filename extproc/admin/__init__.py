"""The admin HTTP server: metrics, probes, `/debug/*` and the status page.

It reads the running app through `AdminSource` and never imports the composition root.
"""

from extproc.admin.http import AdminServer
from extproc.admin.source import AdminSource
from extproc.admin.status import DecisionLog, ReloadStatus

__all__ = ["AdminServer", "AdminSource", "DecisionLog", "ReloadStatus"]
