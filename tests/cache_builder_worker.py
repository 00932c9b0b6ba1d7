"""Builds one cache entry in a real process, slowly, so tests can interrupt it.

    python cache_builder_worker.py ROOT NAME CHUNKS DELAY_S

The builder appends one line to ROOT/builds.log per build it starts, then writes
CHUNKS chunks of 1 MiB with DELAY_S seconds between them. Prints the entry's path.
"""

import sys
import time
from pathlib import Path

from longspec.runtime.model_cache import cached_entry


def main() -> None:
    root, name, chunks, delay = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4])

    def build(directory: Path) -> None:
        with (root / "builds.log").open("a") as log:
            log.write(f"{directory.name}\n")
        (directory / "small.json").write_text('{"ok": true}')
        with (directory / "weights.bin").open("wb") as out:
            for i in range(chunks):
                out.write(bytes([i % 256]) * (1 << 20))
                out.flush()
                time.sleep(delay)

    print(cached_entry(root, name, build, what="a test entry", needed_bytes=chunks << 20), flush=True)


if __name__ == "__main__":
    main()
