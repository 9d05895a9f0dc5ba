import sys

from overmind.bench import main

sys.exit(main())
