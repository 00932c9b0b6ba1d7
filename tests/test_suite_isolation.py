"""The suite never writes to the user's longspec cache: every test process (and what it
starts) has a temporary cache root (conftest.py), where measured forward costs and prepared
heads land; the embedded model's converted checkpoint alone is linked in from the user's cache."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from longspec.runtime import head_cache
from longspec.runtime.default_model import DEFAULT_MODEL_NAME, cache_root
from longspec.speculation import cost_model


def _users_cache() -> Path:
    environment = {k: v for k, v in os.environ.items() if k != "LONGSPEC_CACHE"}
    code = "from longspec.runtime.default_model import cache_root; print(cache_root())"
    return Path(subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True,
                               check=True).stdout.strip())


def test_the_cache_root_is_temporary_here_and_in_processes_tests_start():
    root, users = cache_root(), _users_cache()
    assert root.is_relative_to(tempfile.gettempdir()) and root != users
    for directory in (cost_model.default_directory(), head_cache.default_directory()):
        assert directory.is_relative_to(tempfile.gettempdir()) and not directory.is_relative_to(users)
    code = "from longspec.runtime.default_model import cache_root; print(cache_root())"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert Path(child) == root
    model = root / DEFAULT_MODEL_NAME
    if model.exists():  # linked, not copied or rebuilt
        assert model.is_symlink() and model.resolve() == (users / DEFAULT_MODEL_NAME).resolve()
