import os

import torch

# Triton kernels run interpreted on machines without CUDA (set before any kernel module is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
