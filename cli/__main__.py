import sys

from qmill.cli import main

sys.exit(main.main())
