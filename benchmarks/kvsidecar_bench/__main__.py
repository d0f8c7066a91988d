"""`python -m kvsidecar_bench`."""

import sys

from kvsidecar_bench.runner import main

sys.exit(main())
