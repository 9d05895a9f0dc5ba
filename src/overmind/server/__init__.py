"""``overmind-server``: the daemon (``daemon``), its registry of entries, cold loads and their
fills, and the pool of warm interpreters it starts. Standard library only: never imports torch,
and imports nothing of the client side. ``python -m overmind.server`` starts it."""
