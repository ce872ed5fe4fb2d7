"""shardctl.train: the sharded training loop that runs inside every rank."""
