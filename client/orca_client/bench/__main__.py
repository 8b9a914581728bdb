"""``python -m orca_client.bench``: the orca-bench CLI."""

import sys

from orca_client.bench import main

sys.exit(main())
