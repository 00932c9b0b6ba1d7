"""Builds the certified head's cached copy of a small seeded head in a real process,
slowly, so tests can run two at once or kill one mid-build.

    python head_cache_worker.py ROOT DELAY_S

The build appends a line to ROOT/builds.log when it starts, then sleeps DELAY_S
before deriving the arrays. Prints the xxh3 of every array it got, one line.
"""

import json
import sys
import time
from pathlib import Path

import torch

from longspec.runtime import certified_head, head_cache


def seeded_head() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(2000, 192, generator=generator) * 0.05).to(torch.bfloat16)


def main() -> None:
    root, delay = Path(sys.argv[1]), float(sys.argv[2])
    real = certified_head.quantize_head

    def slow(weight, group):
        with (root / "builds.log").open("a") as log:
            log.write("build\n")
        time.sleep(delay)
        return real(weight, group)

    certified_head.quantize_head = slow
    arrays = head_cache.cached_head_arrays(seeded_head(), certified_head.GROUP, directory=root)
    print(json.dumps({name: head_cache.tensor_digest(t) for name, t in sorted(arrays.items())}), flush=True)


if __name__ == "__main__":
    main()
