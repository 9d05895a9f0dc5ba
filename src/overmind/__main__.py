"""``python -m overmind ...`` is ``overmind ...``::

    python -m overmind status
    python -m overmind run train.py --epochs 3
"""

import sys

from overmind.frontend.run import command

if __name__ == "__main__":
    sys.exit(command())
