"""`python -m pdserve_cli` is the `pdserve` command."""

import sys

from pdserve_cli.main import main

sys.exit(main())
