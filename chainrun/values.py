"""How chainrun's many-instance values are declared: frozen dataclasses whose instances have
no ``__dict__`` (``SLOTS``) where the Python has ``dataclass(slots=True)``, 3.10 on.

A service holds a chain, its spec, its segments and their progress for every active chain
(10,000 at a time in the project's benchmark); each instance's dictionary of a JobSpec's 44
fields is 1.5 KB, its slots 0.4 KB. Python 3.9 makes the same classes with a ``__dict__``.
"""

from __future__ import annotations

import sys
from typing import Any

SLOTS: dict[str, Any] = {"slots": True} if sys.version_info >= (3, 10) else {}
