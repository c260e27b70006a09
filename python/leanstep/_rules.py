"""Argument rules shared by the CPU entry points and the device backends, so
each rule has one copy (the rules on tensors live in the C++ checks)."""

import operator

from ._leanstep import Error


def host_int(value, where, name):
    """`value` as a Python int if it is an integer (an int, a NumPy integer, a
    0-dim integer tensor); anything else (20.7, 2.5, "4") is an error naming
    the argument, never truncated."""
    if isinstance(value, bool):
        raise Error(f"{where}: argument '{name}' must be a host integer (got bool)")
    try:
        return operator.index(value)
    except TypeError:
        raise Error(f"{where}: argument '{name}' must be a host integer "
                    f"(got {type(value).__name__})") from None
