"""C floats as Python sees them. Pure.

Every probability and sampling setting the server holds is a C float; its JSON (nlohmann, double
numbers) prints that float widened to a double, as the shortest decimal that round-trips the double.
"""
from __future__ import annotations

import numpy as np


def widened(x: float) -> float:
    """The float32 nearest `x`, widened to the double the server's JSON holds.

    >>> widened(0.1), widened(1.0)
    (0.10000000149011612, 1.0)
    """
    return float(np.float32(x))
