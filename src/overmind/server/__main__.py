"""``python -m overmind.server`` is ``overmind-server``."""
import sys

from overmind.server.daemon import main

sys.exit(main())
