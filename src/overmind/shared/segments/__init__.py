"""Segments and their bytes: sealed memfds (``memfd``, ``hugepages``), filling one (``writer``),
the pickled form of a result with its storages in segments (``reductions``, ``quirks``), and the
one door to ``overmind._C`` (``native``). Imports ``settings`` and ``process``, never ``calls``,
``patching`` or ``protocol``."""
