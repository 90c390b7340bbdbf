"""hotspare's exceptions: one base, and whether the session recovers from one by its type.

- :class:`HotspareError`: every exception hotspare raises derives from it.
- :class:`RecoverableError`: a peer, the group or a transfer failed; a survivor's session
  recovers in place (``Session.resilient``).
- :class:`FatalError`: the job cannot go on as it is (state lost everywhere, a refused join, a
  set-up that fails the same way on every spare); the session never recovers from it, and
  the message says what was lost and what to do.
- User mistakes (a config key, a flag, a control value of the wrong shape) are ``ValueError``s
  that derive from :class:`HotspareError` too (``ConfigError``, ``BadMessage``, ``SecretError``).

Errors from outside hotspare are classified in :func:`hotspare.recovery.is_distributed_error`:
by type where torch gives one (``DistBackendError``, ``DistNetworkError``, ``DistStoreError``,
``TimeoutError``, ``ConnectionError``), and by gloo's and NCCL's message text only as the
documented last resort (torch 2.13's gloo raises a plain ``RuntimeError`` when a peer's connection
closes: tests/test_recovery_pieces.py pins the texts).
"""
from __future__ import annotations


class HotspareError(Exception):
    """Base of every exception hotspare raises."""


class RecoverableError(HotspareError, RuntimeError):
    """A peer, the group or a transfer failed: the session recovers in place."""


class FatalError(HotspareError, RuntimeError):
    """The job cannot go on as it is; the message says what was lost and what to do."""
