"""``python -m devtools.chaos`` (what ``python3 dev.py chaos`` runs)."""

import sys

from devtools.chaos.command import main

sys.exit(main())
