"""Rank 1 crashes natively (reads address 0), in a Python function named for it; rank 0 ends normally
(tests/test_data_parallel.py: the launcher names the signal and, from faulthandler, that function and line)."""

import ctypes
import os


def read_address_zero():
    ctypes.string_at(0)


if os.environ["RANK"] == "1":
    read_address_zero()
