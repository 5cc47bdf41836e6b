"""``python -m devtools.chaos`` (what ``python3 dev.py chaos`` runs)."""

import sys

from devtools.chaos.run import main

sys.exit(main())
