import sys
from pathlib import Path

import torch

# Tiny test models are dominated by per-op overhead; one intra-op thread avoids
# OpenMP barrier costs that make them tens of times slower on a busy 2-core machine.
torch.set_num_threads(1)

sys.path.insert(0, str(Path(__file__).parent))
