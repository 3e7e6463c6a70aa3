"""Benchmarks: ``pytest bench --benchmark-json=bench/results/latest.json`` then
``python bench/report.py bench/results/latest.json``."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.backends.cuda.matmul.allow_tf32 = True  # benchmark what users run
