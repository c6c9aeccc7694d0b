"""The load client, `pensieve.ops.load`, under the name the GPU scripts call it by:

    python3 -m benchmarks.bench_serve FILE --nats-url URL [--concurrency N] [--probe-every S]
        [--json OUT] ...

(`pensieve bench` runs the same load with a progress bar, a table, rate sweeps and plots.)
"""

from __future__ import annotations

import sys

from pensieve.ops.load import LoadOptions, main, run_load, server_stats

__all__ = ["LoadOptions", "main", "run_load", "server_stats"]

if __name__ == "__main__":
    sys.exit(main())
