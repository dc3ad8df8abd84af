"""``python -m requant`` is the ``requant`` command."""

import sys

from requant.cli.main import main

sys.exit(main())
