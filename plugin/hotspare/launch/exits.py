"""How ``hotspare-run`` ends: its exit codes, and the one last line that says the code and why.

Every launcher, on every node, ends with ``[hotspare-run] exit <code>: <cause>`` after everything
else it prints (its workers and keepers are gone by then), whatever the way out: the job
finished, it was stopped, the node fenced itself, a flag was refused, or an unexpected error
(after its traceback). The code is 0 only when training finished on every rank.
"""
from __future__ import annotations

import traceback

from .processes import log

BAD_LAUNCH_EXIT_CODE = 2
"""A flag, the store's address or the job's secret was refused before anything started."""
ABORT_EXIT_CODE = 3
"""Exit code when a worker found the job unrecoverable (``control.ABORT``): state was lost."""
FENCED_EXIT_CODE = 4
"""Exit code of a launcher that lost the control store for ``node_timeout_s`` and stopped its
workers (partitioned from node 0, or node 0 died)."""
BAD_CONTROL_EXIT_CODE = 5
"""Exit code of a launcher that read a control value signed by the job but not of the shape its
key holds (a bug: a stranger's values are ignored, unsigned)."""
UNEXPECTED_EXIT_CODE = 1
"""An error hotspare-run did not expect (its traceback is printed before the last line)."""


def say_exit(code: int, cause: str) -> None:
    """The launcher's last line."""
    cause = " ".join(cause.split()) or "(no cause recorded)"
    log(f"exit {code}: {cause[:1000]}")


def plan_exit_code(failures: list[dict]) -> int:
    """The exit code of a job that a plan stopped: its first failure's (a signal: 128 + it)."""
    code = failures[0]["code"] if failures else 1
    return code if code > 0 else 128 - code


def say_unexpected(exc: BaseException) -> int:
    """An error hotspare-run did not expect: its traceback, then the last line."""
    traceback.print_exception(exc)
    say_exit(UNEXPECTED_EXIT_CODE, f"unexpected error in hotspare-run: {type(exc).__name__}: {exc} (traceback above)")
    return UNEXPECTED_EXIT_CODE
