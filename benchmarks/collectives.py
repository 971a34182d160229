"""Collective benchmark (nccl-tests conventions): a thin wrapper of `python -m hpctrain.bench.collectives`.

    python benchmarks/collectives.py --nproc 2 --max-bytes 64M               # 2 local ranks, gloo
    srun -N2 --ntasks-per-node=8 python benchmarks/collectives.py            # NCCL on GPUs
    python -m hpctrain.bench.sweep local_gloo --out DIR --wait --report      # sweeps: hpctrain.bench.sweep

Every option: `python benchmarks/collectives.py --help`.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hpctrain.bench.collectives import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
