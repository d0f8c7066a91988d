"""`python -m kvsidecar.bench`."""

import sys

from kvsidecar.bench.runner import main

sys.exit(main())
