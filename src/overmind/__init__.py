"""overmind: near-instant PyTorch model loading.

Importing ``overmind`` patches nothing. Opt in explicitly::

    import overmind.api
    overmind.api.monkey_patch_all()
"""

__version__ = "0.1.0"
