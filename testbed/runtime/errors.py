"""The error type of the testbed library: something the user can fix (a profile value, a missing file, no
device registered). The `multispin` command line prints it as `multispin <cmd>: error: ...` with exit
status 2 and no traceback; a program that calls the library catches it like any exception."""

from __future__ import annotations

import difflib


class TestbedError(Exception):
    """An error the user can fix; printed without a traceback."""

    __test__ = False  # not a pytest test class, despite its name


def did_you_mean(word: str, choices, cutoff: float = 0.6) -> str:
    """'; did you mean X?' for the closest of `choices` (difflib), or '' when none is close."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=cutoff)
    return f"; did you mean {close[0]}?" if close else ""
