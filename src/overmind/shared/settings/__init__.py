"""Settings, at the bottom of ``shared``: every ``OVERMIND_*`` variable (``config``), the memory
this machine and its cgroups allow (``host_memory``), and what imports read from the environment
(``import_env``). Standard library only; imports nothing else of overmind."""
