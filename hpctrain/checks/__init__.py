"""Login-node checks: a composed config, the cluster it asks for (Slurm), a Kubernetes manifest's values.
Each yields messages that name the key and the fix; nothing here imports torch."""
