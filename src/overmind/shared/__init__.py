"""What every process of overmind uses: the wire protocol, settings, segments, the pickled form of
a result, and the description of a load call. Imports no side (``client``, ``server``, ``warm``,
``frontend``); each side imports from here."""
