"""A user script that ends, on every rank, with the exit code it is given.

Every rank, not just one: a rank that ended well would make its node's torchrun
agent wait out the exit barrier (300 s) for the failed node's agent."""

import os
import sys

print(f"attempt {os.environ['SHARDCTL_ATTEMPT']} rank {os.environ['RANK']}", flush=True)
sys.exit(int(sys.argv[1]))
