import sys

from orca_openai.cli import main

sys.exit(main())
