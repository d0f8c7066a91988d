"""`python -m kvsidecar`."""

import sys

from kvsidecar.cli.main import main

sys.exit(main())
