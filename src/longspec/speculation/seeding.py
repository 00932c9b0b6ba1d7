"""Random streams derived from one request seed.

The verifier draws from the request's generator. A drafter that samples (a sampled
chain, sampled tree children) must not share that stream — its draws would shift
the verifier's — and must not use the global torch stream, or one seed would not
give one output. It gets a second generator spawned from the same seed.
"""

from __future__ import annotations

import numpy as np
import torch

# Spawn key of the drafters' stream (the verifier's is the seed itself).
_DRAFTER_STREAM = 1


def drafter_generator(verifier: torch.Generator) -> torch.Generator:
    """A generator for drafters, determined by the verifier generator's seed."""
    words = np.random.SeedSequence(verifier.initial_seed(), spawn_key=(_DRAFTER_STREAM,)).generate_state(2, np.uint32)
    seed = (int(words[0]) << 32 | int(words[1])) >> 1  # 63 bits: every torch build accepts it
    return torch.Generator(device=verifier.device).manual_seed(seed)
