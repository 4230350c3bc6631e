"""The live page at ``/dashboard``: a static page (no build step) and the compact JSON it polls.

- ``static/``: the page, its script and style, and uPlot (vendored, MIT, its licence beside it);
- ``history``: samples of the gateway's counters while someone looks, bounded in time;
- ``view``: one refresh's figures, computed on request from the gateway's own state
  and its replicas' ``/stats``: nothing here runs on the request path.
"""

from __future__ import annotations

from pathlib import Path

STATIC = Path(__file__).resolve().parent / "static"
