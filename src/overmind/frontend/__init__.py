"""The commands a user types: ``overmind`` (``cli``) and its fast path ``overmind run``
(``run``, standard library only)."""
