"""Warm interpreters and what runs in them: the interpreter the server starts per context
(``interpreter``), a cold load in one of its forks (``loader``), and a script run in another
(``child``). They run the user's python and import torch; they import nothing of the server."""
