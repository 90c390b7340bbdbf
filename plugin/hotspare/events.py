"""Events: JSON lines with a monotonic timestamp, rank, generation and version.

One file per rank (``events.rank<R>.jsonl``) under the configured directory; recipes merge
them into timelines. Writing is line-buffered and thread-safe (the mirror thread logs too).
:func:`log` writes the human-readable line (stderr) that goes with them.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time


class EventLog:
    """Appends events for one rank; a no-op when ``directory`` is empty."""

    def __init__(self, directory: str, rank: int, generation: int = 0):
        self.rank, self.generation = rank, generation
        self._lock = threading.Lock()
        self._file = None
        if directory:
            os.makedirs(directory, exist_ok=True)
            self._file = open(os.path.join(directory, f"events.rank{rank}.jsonl"), "a", encoding="utf-8",
                              buffering=1)

    def __call__(self, kind: str, version: int | None = None, **fields) -> None:
        if self._file is None:
            return
        record = {"t": time.monotonic(), "kind": kind, "rank": self.rank, "generation": self.generation,
                  "version": version, **fields}
        line = json.dumps(record)
        with self._lock:
            if self._file is not None:
                self._file.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def log(msg: str) -> None:
    """A line for the person watching the job (stderr), next to the JSON events."""
    print(f"[hotspare] {msg}", file=sys.stderr, flush=True)
