"""A rehearsal: rebuild, and drop, what a program loaded last time, in a run's child forked
ahead of its run (Note [A run's child is forked ahead] in overmind.warm.children)::

    pristine = rehearse(program)    # False: something spoke (a warning, a log record)

Each entry is looked up as a reference is (``fetch_entry``), marked as a rehearsal, so the server
counts no hit, records nothing for the program and takes no file as handed to it (Note [Reading
back a lost file] in overmind.client.prefetch: the run this child becomes says so itself); nothing
is kept. What the rebuild touches for the first time, it touches here: the interpreter's pages
the child writes to (reference counts, allocator pools, specialised bytecode), each a
copy-on-write fault, and the first calls of the rebuild's code. A warning or log record the rehearsal caused would be one the run never
shows (a ``"once"`` warning, ``warning_once``), so the caller throws such a child away.
"""

from __future__ import annotations

import gc
import logging
import warnings

__all__ = ["rehearse", "MAX_ENTRIES"]

MAX_ENTRIES = 64  # entries one rehearsal rebuilds


def rehearse(program: str) -> bool:
    """Rebuild and drop the entries ``program`` loaded in its last process; whether nothing spoke.
    Raises what the connection raises (the caller then has a child that rehearsed less)."""
    from overmind.client.cache import fetch_entry
    from overmind.client.connection import LoadingConnection
    from overmind.shared import protocol as P
    from overmind.shared.settings.config import Config

    spoke = []
    make_record = logging.getLogRecordFactory()

    def counted(*args, **kwargs):
        spoke.append(args[:2])
        return make_record(*args, **kwargs)

    conn = LoadingConnection.open(Config.from_env(), role="client", autostart=False)
    logging.setLogRecordFactory(counted)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # recorded, never shown, and no registry written
            reply = conn.simple(P.Prefetch(program, rehearsal=True), P.PrefetchReply)
            for item in reply.entries[:MAX_ENTRIES]:
                if isinstance(item, list) and item and isinstance(item[0], str):
                    fetch_entry(item[0], [conn], rehearsal=True)
    finally:
        logging.setLogRecordFactory(make_record)
        conn.close()
        gc.collect()
    return not (caught or spoke)
