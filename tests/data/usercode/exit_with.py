"""A user script that ends with the exit code it is given (rank 0 only, others 0)."""

import os
import sys

print(f"attempt {os.environ['SHARDCTL_ATTEMPT']} rank {os.environ['RANK']}", flush=True)
if os.environ["RANK"] == "0":
    sys.exit(int(sys.argv[1]))
