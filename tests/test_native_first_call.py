"""The native library is built or loaded once per process even when two threads ask at
once (a load's `prebuild` thread and the load itself): a second registration of its
operators would abort the process."""

from __future__ import annotations

import threading
import time

import torch.utils.cpp_extension

from longspec.runtime import native


def test_threads_asking_at_once_build_the_library_once(monkeypatch, tmp_path):
    calls = []

    def slow_load(**kwargs):
        calls.append(kwargs["name"])
        time.sleep(0.2)  # a build: the other threads arrive meanwhile

    monkeypatch.setattr(torch.utils.cpp_extension, "load", slow_load)
    monkeypatch.setattr(native, "_build_lock", lambda: _nothing())
    monkeypatch.setenv(native.DISABLE_VARIABLE, "1")
    native._built_or_loaded.cache_clear()
    try:
        threads = [threading.Thread(target=native.native_ops) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert calls == [native.LIBRARY]
    finally:
        native._built_or_loaded.cache_clear()  # the next caller loads the real library


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
