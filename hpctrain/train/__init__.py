"""What every rank runs once torch.distributed is up: the loop (loop.py), the optimizer and its
schedule (optim.py), the training state besides tensors (state.py), metrics, collective preemption,
and requeueing after it under Slurm."""
