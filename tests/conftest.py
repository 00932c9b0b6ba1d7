import os
import sys
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run through Triton's interpreter. Triton reads the
# switch when it is first imported (its own library functions are defined then), and
# other tests may import it (through transformers or torch) before the kernel tests.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# Every test process, and every process a test starts, keeps the longspec cache (measured
# forward costs, prepared heads, whatever a test builds) in a temporary directory: a
# measurement taken while the suite keeps every core busy must never reach the user's cache.
# Only the embedded model's converted checkpoint, where the user's cache has it, is linked in
# (read, never rebuilt there).
def _temporary_cache_root() -> None:
    import atexit
    import shutil
    import tempfile

    from longspec.runtime.default_model import DEFAULT_MODEL_NAME, cache_root

    users = cache_root()
    root = Path(tempfile.mkdtemp(prefix="longspec-test-cache-"))
    if (users / DEFAULT_MODEL_NAME).is_dir():
        (root / DEFAULT_MODEL_NAME).symlink_to(users / DEFAULT_MODEL_NAME, target_is_directory=True)
    os.environ["LONGSPEC_CACHE"] = str(root)
    atexit.register(shutil.rmtree, root, ignore_errors=True)


_temporary_cache_root()

# Tiny test models are dominated by per-op overhead; one intra-op thread avoids
# OpenMP barrier costs that make them tens of times slower on a busy 2-core machine.
torch.set_num_threads(1)

sys.path.insert(0, str(Path(__file__).parent))

# The suite runs on every core up to MAX_TEST_WORKERS (pytest-xdist's `-n auto`, set in
# pyproject.toml): each test pins one thread, so workers do not fight over cores, and
# each worker loads its own models, so their number is capped by memory, not cores.
MAX_TEST_WORKERS = 4


def pytest_xdist_auto_num_workers(config):
    return max(1, min(os.cpu_count() or 1, MAX_TEST_WORKERS))


@pytest.fixture(autouse=True, scope="session")
def _cost_models_measured_by_tests_stay_out_of_the_users_cache(tmp_path_factory):
    """Tests measure forward costs while the suite keeps every core busy: such a
    measurement in the user's cache would price `auto`'s trees too cheap afterwards."""
    from longspec.speculation import cost_model

    from longspec.runtime import head_cache

    from longspec.speculation import cost_measurement

    # Tests of `auto` decide from a measured curve, as before; the default curve has tests of its own.
    cost_measurement.set_policy("now")
    directory = tmp_path_factory.mktemp("cost-model")
    original = cost_model.default_directory
    cost_model.default_directory = lambda: directory
    # Tiny models' certified heads, too, stay out of the user's cache.
    heads = tmp_path_factory.mktemp("prepared")
    original_heads = head_cache.default_directory
    head_cache.default_directory = lambda: heads
    yield
    cost_model.default_directory = original
    head_cache.default_directory = original_heads
