"""Test-wide settings.

Every model in the tests is tiny, so torch's intra-op threads only add synchronisation; on a
busy 2-core machine an OpenMP barrier around a 3×64 softmax costs 10+ ms. One thread keeps the
suite fast and its timing independent of what else runs.
"""

import torch

torch.set_num_threads(1)
