"""What every process of overmind uses, in rooms that import downwards only::

    protocol    the wire: frames and messages, connecting, handing a run over, contexts
    segments    sealed memfds and the pickled bytes in them      calls    load calls, keys
    patching    wrapping the loading functions
    process     traits, priority, teardown
    settings    OVERMIND_* settings, host memory, what imports read

A room imports itself and the rooms below it; ``segments``, ``calls`` and ``patching`` import
none of each other (tests/unit/test_layers.py holds the directions). ``shared`` imports no side
(``client``, ``server``, ``warm``, ``frontend``); each side imports from here."""
