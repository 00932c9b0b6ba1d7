"""Builds the prepared weights of a tiny checkpoint in a real process, slowly, so tests can
run two at once or kill one mid-build.

    python prepared_weights_worker.py CHECKPOINT ROOT DELAY_S

The build appends a line to ROOT/builds.log when it starts, then sleeps DELAY_S before
making the parameters. Prints the xxh3 of every parameter it got, one line.
"""

import json
import sys
import time
from pathlib import Path

import torch

from longspec.runtime import prepared_weights
from longspec.runtime.checkpoint_config import read_config
from longspec.runtime.head_cache import tensor_digest
from longspec.runtime.loading import _read_shards, fused_params


def main() -> None:
    checkpoint, root, delay = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])
    hf_config = read_config(checkpoint)

    def slow():
        with (root / "builds.log").open("a") as log:
            log.write("build\n")
        time.sleep(delay)
        return fused_params(hf_config, _read_shards(sorted(checkpoint.glob("*.safetensors"))), torch.bfloat16)

    params = prepared_weights.cached_params(checkpoint, torch.bfloat16, slow, root=root)
    print(json.dumps({name: tensor_digest(t) for name, t in sorted(params.items())}), flush=True)


if __name__ == "__main__":
    main()
