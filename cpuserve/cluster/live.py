"""The request routers Ray Serve created in this process, for the ingress's /health and /metrics.

Ray ships a custom router class by value (cloudpickle), so a class attribute of it is a copy
per process and per deserialization; this module is imported by reference and is the one place
both the router and the ingress see. Routers add themselves and are only weakly held.
"""

from __future__ import annotations

import weakref
from typing import Any

ROUTERS: weakref.WeakSet[Any] = weakref.WeakSet()
