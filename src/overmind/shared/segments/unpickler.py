"""An unpickler whose persistent ids are indexes into a table, looked up in C on every Python.

    obj = table_unpickler(io.BytesIO(payload), table).load()

Note [Persistent ids across Pythons]
The skeleton's persistent ids are indexes into the table of storages and tensors built before
unpickling (Note [Tensors as table entries] in overmind.shared.segments.reductions), and the
lookup runs once per tensor, so it must not be a Python frame: ``list.__getitem__`` itself.
Up to Python 3.12 the C ``_pickle.Unpickler`` takes ``persistent_load`` as an attribute set on
the instance. From 3.13 that attribute is read-only (``'_pickle.Unpickler' object attribute
'persistent_load' is read-only``): the unpickler reads ``persistent_load`` from its class when
it is created, as a method or any callable. So on every version a subclass is made whose
class attribute is the table's own ``__getitem__`` (a ``staticmethod``, so it is never bound
to the unpickler), and no Python code runs per id. The class is made per table: a few
microseconds per load, and no table outlives its load.
"""

from __future__ import annotations

import pickle
from typing import IO

__all__ = ["table_unpickler"]


def table_unpickler(file: IO[bytes], table: list) -> pickle.Unpickler:
    """A ``pickle.Unpickler`` of ``file`` whose ``persistent_load(i)`` is ``table[i]``."""
    cls = type("TableUnpickler", (pickle.Unpickler,), {"persistent_load": staticmethod(table.__getitem__)})
    return cls(file)
