import sys

from meshwise.cli.main import main

sys.exit(main())
