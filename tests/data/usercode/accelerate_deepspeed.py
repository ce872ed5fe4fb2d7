"""A plain accelerate script, as a user writes it: `Accelerator()` with no arguments,
a few steps, `save_state` into the folder given as the first argument. Each rank
reports what accelerate made of its launcher (one line, `ACCEL {...}`)."""

import json
import os
import sys

import torch
from accelerate import Accelerator

accelerator = Accelerator()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
loader = torch.utils.data.DataLoader(data, batch_size=4)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
dtype = next(model.parameters()).dtype  # DeepSpeed's bf16 mode casts the module
for step, (x, y) in enumerate(loader):
    loss = torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    if step == 2:
        break
accelerator.save_state(sys.argv[1])
report = {
    "rank": int(os.environ["RANK"]),
    "distributed_type": str(accelerator.distributed_type).split(".")[-1],
    "num_processes": accelerator.num_processes,
    "process_index": accelerator.process_index,
    "model": type(model).__name__,
    "batches": len(loader),
}
sys.stdout.write("ACCEL " + json.dumps(report) + "\n")
sys.stdout.flush()
