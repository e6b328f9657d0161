"""What the grading tests share: the test rubric and a run of `attn-spec grade` in a fresh process."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
ROOT = os.geteuid() == 0  # only root grades as sandbox users


def rubric(output_kb: int) -> str:
    """The tests' rubric: the quick profile, a fixed seed, tight limits, ``output_kb`` of output kept."""
    return ('profile = "quick"\nseed = 7\n[limits]\nimport_seconds = 5\ncall_seconds = 4\n'
            f"submission_seconds = 120\nmemory_mb = 256\noutput_kb = {output_kb}\n")


def grade(*args, cwd=None, env=None, timeout=300) -> subprocess.CompletedProcess:
    """``attn-spec grade ARGS`` as a user runs it."""
    return subprocess.run([sys.executable, "-m", "attn_spec", "grade", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout, env=env)
