"""numpy.testing.assert_array_equal with a fast path for the passing case.

numpy 2.4's ``assert_array_equal`` spends ~4 ms on two equal 64³ uint64 volumes (its NaN/inf
bookkeeping), 60 times ``np.array_equal``; the suite compares thousands of chunks. `install`
replaces it by a function that returns at once when ``np.array_equal`` says the arrays are equal
(same shape, every element equal: exactly when numpy's own would pass) and otherwise calls numpy's
own, so every failure, NaN rule, broadcast scalar and message is numpy's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.testing

__all__ = ["assert_array_equal", "install"]

_numpy_own = numpy.testing.assert_array_equal


def assert_array_equal(actual: Any, desired: Any, *args: Any, **kwargs: Any) -> None:
    """numpy's ``assert_array_equal``; equal arrays of one shape return without its bookkeeping."""
    if not kwargs.get("strict"):
        try:
            if np.array_equal(actual, desired):
                return
        except Exception:  # noqa: BLE001 - ragged or odd input: numpy's own says what it is
            pass
    _numpy_own(actual, desired, *args, **kwargs)


def install() -> None:
    """Make ``np.testing.assert_array_equal`` (and ``numpy.testing``'s) this one, for the session."""
    numpy.testing.assert_array_equal = assert_array_equal
