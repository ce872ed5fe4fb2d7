"""A user script that reports what its launcher handed it: the accelerate state an
`Accelerator()` builds, or the rendered DeepSpeed config, and its arguments."""

import json
import os
import sys

report = {"rank": int(os.environ["RANK"]), "world": int(os.environ["WORLD_SIZE"])}
report["argv"] = sys.argv[1:]
if os.environ.get("SHARDCTL_ACCELERATE_CONFIG"):
    from accelerate import Accelerator

    accelerator = Accelerator()
    report["distributed_type"] = str(accelerator.distributed_type).split(".")[-1]
    report["num_processes"] = accelerator.num_processes
    with open(os.environ["SHARDCTL_ACCELERATE_CONFIG"]) as f:
        report["config"] = f.read()
    report["env"] = {k: v for k, v in os.environ.items() if k.startswith(("ACCELERATE_", "FSDP_"))}
if os.environ.get("SHARDCTL_DEEPSPEED_CONFIG"):
    with open(os.environ["SHARDCTL_DEEPSPEED_CONFIG"]) as f:
        report["zero_stage"] = json.load(f)["zero_optimization"]["stage"]
# One write per line: the ranks share the launcher's stdout, and print() writes the
# text and the newline separately, so two ranks' lines could run together.
sys.stdout.write("PROBE " + json.dumps(report) + "\n")
sys.stdout.flush()
