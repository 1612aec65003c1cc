"""Checks for tests that run the ``edgeflow`` command line as a user would."""

from __future__ import annotations

import subprocess


def one_clear_line(out: subprocess.CompletedProcess, *needles: str) -> str:
    """A user's mistake: a non-zero exit, no traceback, and one line on stderr that holds every needle."""
    assert out.returncode != 0, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]
