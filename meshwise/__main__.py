import sys

from meshwise.cli import main

sys.exit(main())
