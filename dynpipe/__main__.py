from __future__ import annotations

import sys

from dynpipe.cli import main

sys.exit(main())
