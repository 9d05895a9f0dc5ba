"""The user's process: the cache path behind the patched loaders (``cache``), the connection to
the server (``connection``), prefetch, and the hand-off of a script to a warm interpreter.
Users call ``overmind.api``; nothing here is public."""
