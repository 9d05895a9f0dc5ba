"""Load calls and their keys: a call as it travels to a loader and the key it maps to (``keys``),
the caller's state a load reads and changes (``callstate``), the warnings and logs a hit replays
(``replay``), and compiled packages (``compiled``). Imports ``settings`` and ``process``, never
``segments``, ``patching`` or ``protocol``."""
