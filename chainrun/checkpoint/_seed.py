"""The chain's seed (``CHAINRUN_SEED``): what the framework helpers seed from when the script
does not seed itself.

chainrun gives each chain a seed of its own, the same in every segment: repetitions of a
sweep's configuration then differ, and each one repeats when run again. The framework helpers
(``chainrun.checkpoint.torch``, ``.tensorflow``) seed Python's, NumPy's and the framework's
random numbers from it when they are imported, unless the framework was seeded already:
whatever the script seeds after that import wins, and on a resume the states the checkpoint
holds win over both, so a resumed run goes on exactly as it would have.
"""

from __future__ import annotations

import os
import random
import warnings
from typing import Optional

SEED_VAR = "CHAINRUN_SEED"
SEED_LIMIT = 2**32  # NumPy's legacy seed must be below it (model.SEED_LIMIT: the helper imports no chainrun)


def chain_seed() -> Optional[int]:
    """``CHAINRUN_SEED`` as an int, or None outside chainrun (a bad value warns and is None)."""
    text = os.environ.get(SEED_VAR, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < SEED_LIMIT:
        warnings.warn(
            f"{SEED_VAR}={text!r} is not a whole number from 0 to {SEED_LIMIT - 1}: "
            "nothing is seeded from it",
            stacklevel=2,
        )
        return None
    return value


def seed_python_and_numpy(seed: int) -> None:
    """Seed Python's ``random`` and, where NumPy is installed, its global generator."""
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(seed)
