"""The process itself: what makes it the one its user started (``traits``), its CPU scheduling
(``priority``) and how it leaves (``teardown``). Standard library only; above ``settings`` only."""
