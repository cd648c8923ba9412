"""The CPU allocator setting every ttt-bench command applies (ttt_bench/allocator.py)."""

import ctypes.util
import os
import platform
import subprocess
import sys

import pytest

CHECK = "from ttt_bench.allocator import retain_freed_memory; print(retain_freed_memory())"


def _run(env_value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TTT_BENCH_RETAIN_MEMORY"}
    if env_value is not None:
        env["TTT_BENCH_RETAIN_MEMORY"] = env_value
    # a fresh process: mallopt changes the allocator for the rest of the process
    return subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                    reason="glibc's mallopt: Linux with glibc only")
def test_glibc_malloc_is_told_to_keep_freed_memory():
    assert ctypes.util.find_library("c")
    assert _run(None) == "True"


def test_the_setting_can_be_turned_off():
    assert _run("0") == "False"
