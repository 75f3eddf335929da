"""``python -m offload_engine``."""

import sys

from offload_engine.cli import main

sys.exit(main())
