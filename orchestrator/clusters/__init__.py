"""Cluster backends: local (torchrun here), slurm (submitit), k8s (PyTorchJob)."""
