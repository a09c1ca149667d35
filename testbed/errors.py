"""The error type of the testbed library: something the user can fix (a profile value, a missing file, no
device registered). The `multispin` command line prints it as `multispin <cmd>: error: ...` with exit
status 2 and no traceback; a program that calls the library catches it like any exception."""

from __future__ import annotations


class TestbedError(Exception):
    """An error the user can fix; printed without a traceback."""

    __test__ = False  # not a pytest test class, despite its name
