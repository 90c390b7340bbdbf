"""The job secret and the signature every control value carries.

Anyone who can reach the control store's port can write to it (a TCPStore has no access
control). So every value the job acts on is signed: an HMAC-SHA256, keyed by a per-job secret,
over the job id, the store key and the value. A reader that finds a value whose signature does
not hold treats it as absent and says so once, naming the key. What this stops and what it
cannot: docs/control-plane.md.

The secret: node 0's ``hotspare-run`` makes one for a single-node job; a job on several nodes
reads it from ``--job-secret-file`` on every node (the same file). Workers get it in their
environment (``HOTSPARE_JOB_SECRET``, hex), readable only by their own user. It is never written
to the store or to a log.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat

from .. import env
from ..errors import HotspareError

SECRET_BYTES = 32
MIN_SECRET_BYTES = 16
_TAG = "hs1."
_MAC_HEX = 64  # sha256


class SecretError(HotspareError, ValueError):
    """The job secret is missing, unreadable, too short or readable by others."""


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def read_secret_file(path: str) -> bytes:
    """The secret in ``path`` (its bytes, surrounding whitespace stripped): at least
    :data:`MIN_SECRET_BYTES`, in a regular file that only its owner may read or write."""
    try:
        info = os.stat(path)
        with open(path, "rb") as f:
            data = f.read().strip()
    except OSError as exc:
        raise SecretError(f"--job-secret-file {path}: cannot read it ({exc.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        raise SecretError(f"--job-secret-file {path}: not a regular file")
    if info.st_mode & 0o077:
        raise SecretError(f"--job-secret-file {path}: readable or writable by others (mode "
                          f"{stat.S_IMODE(info.st_mode):o}); run: chmod 600 {path}")
    if len(data) < MIN_SECRET_BYTES:
        raise SecretError(f"--job-secret-file {path}: {len(data)} bytes; a job secret has at least "
                          f"{MIN_SECRET_BYTES} (make one: head -c 32 /dev/urandom | xxd -p > {path})")
    return data


def write_secret_file(path: str) -> str:
    """Make a new job secret in ``path``, readable and writable by its owner only (for the
    launchers' ``--job-secret-file``); returns ``path``."""
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w", encoding="ascii") as f:
        f.write(new_secret().hex())
    return path


def secret_from_env() -> bytes:
    text = os.environ.get(env.HOTSPARE_JOB_SECRET, "")
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        secret = b""
    if len(secret) < MIN_SECRET_BYTES:
        raise SecretError(f"{env.HOTSPARE_JOB_SECRET} is {'not set' if not text else 'not a hex secret'}: "
                          f"this process was not started by hotspare-run, or its environment was cleared; "
                          f"it cannot read or write the job's control store")
    return secret


class Signer:
    """Signs and checks control values for one job."""

    def __init__(self, secret: bytes, job_id: str):
        if len(secret) < MIN_SECRET_BYTES:
            raise SecretError(f"a job secret has at least {MIN_SECRET_BYTES} bytes")
        self._secret, self.job_id = secret, job_id

    @classmethod
    def from_env(cls) -> "Signer":
        return cls(secret_from_env(), os.environ.get(env.HOTSPARE_JOB_ID, ""))

    def secret_hex(self) -> str:
        """The secret for a worker's environment (``HOTSPARE_JOB_SECRET``); never for a log."""
        return self._secret.hex()

    def for_job(self, job_id: str) -> "Signer":
        return Signer(self._secret, job_id)

    def _mac(self, key: str, value: str, job_id: str) -> str:
        message = f"{job_id}\0{key}\0{value}".encode("utf-8", errors="surrogateescape")
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def private_name(self, name: str) -> str:
        """16 hex digits only holders of the secret can compute for ``name`` in this job: part of
        the store keys a stranger must not find (the lists' counters and entries)."""
        message = f"{self.job_id}\0private\0{name}".encode("utf-8", errors="surrogateescape")
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()[:16]

    def sign(self, key: str, value: str, job_id: str | None = None) -> str:
        return f"{_TAG}{self._mac(key, value, self.job_id if job_id is None else job_id)}.{value}"

    def open(self, key: str, stored: bytes | str, job_id: str | None = None) -> str | None:
        """The value ``stored`` under ``key`` carries, or None when its signature does not hold."""
        text = stored.decode("utf-8", errors="surrogateescape") if isinstance(stored, bytes) else stored
        if not text.startswith(_TAG) or len(text) < len(_TAG) + _MAC_HEX + 1 or text[len(_TAG) + _MAC_HEX] != ".":
            return None
        mac, value = text[len(_TAG):len(_TAG) + _MAC_HEX], text[len(_TAG) + _MAC_HEX + 1:]
        expected = self._mac(key, value, self.job_id if job_id is None else job_id)
        return value if hmac.compare_digest(mac, expected) else None
