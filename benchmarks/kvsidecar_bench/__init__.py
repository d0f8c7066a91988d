"""`kvsidecar bench`: the daemon's data path measured side by side with in-process Mooncake, its real client and memcpy.

python -m kvsidecar_bench --quick          # under a minute, prints the tables
python -m kvsidecar_bench                  # the full run: docs/benchmarks/results.{md,json} and throughput.png
"""

from kvsidecar_bench.runner import run
from kvsidecar_bench.settings import add_arguments

__all__ = ["add_arguments", "run"]
