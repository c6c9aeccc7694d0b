"""The HTTP API's keys: one per tenant, made by `pensieve tenant add`, kept only as hashes.

    <data-dir>/http/keys/<tenant>.sha256    the SHA-256 of the tenant's key, hex (0600; folder 0700)

A key is 256 random bits, so one SHA-256 is as good a hash as any slower one: nobody can guess
a key from its hash. `ApiKeys` maps a presented key to its tenant, comparing the hashes in
constant time, and reads the folder again whenever it changed (a tenant added while the server
runs is known at its first request).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import threading
from pathlib import Path

from pensieve.actors.ingress.openai_api import unauthorized
from pensieve.actors.wire.subjects import check_tenant_name

KEY_PREFIX = "pk-"
SUFFIX = ".sha256"


def keys_dir(data_dir: Path) -> Path:
    return data_dir.absolute() / "http" / "keys"


def new_api_key(data_dir: Path, tenant: str, replace: bool = False) -> str:
    """Make tenant `tenant`'s API key, keep its hash, and return it (shown this once); with
    `replace`, in place of the key it has (which stops working at once)."""
    check_tenant_name(tenant)
    directory = keys_dir(data_dir)
    for folder in (directory.parent, directory):
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        folder.chmod(0o700)  # mkdir's mode is cut by the umask
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    path = directory / f"{tenant}{SUFFIX}"
    # written whole, then linked into place: a reader never sees half a file, and the link
    # fails if the tenant has a key (never silently replaced)
    temporary = directory / f".{tenant}.{os.getpid()}"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(_digest(key) + "\n")
    try:
        if replace:
            os.replace(temporary, path)
        else:
            os.link(temporary, path)
    except FileExistsError:
        raise ValueError(f"tenant {tenant} has an API key already ({path})") from None
    finally:
        temporary.unlink(missing_ok=True)
    return key


def remove_api_key(data_dir: Path, tenant: str) -> None:
    """Tenant `tenant`'s API key stops working (a running HTTP ingress rereads the folder)."""
    check_tenant_name(tenant)
    (keys_dir(data_dir) / f"{tenant}{SUFFIX}").unlink(missing_ok=True)


class ApiKeys:
    """Who presents which key. With `required` False (a server without accounts, where every
    client reaches everything anyway), a request with no key or another key than a tenant's is
    the service's own, as vLLM without --api-key takes any key ("EMPTY")."""

    def __init__(self, data_dir: Path, required: bool = True) -> None:
        self.directory = keys_dir(data_dir)
        self.required = required
        self._lock = threading.Lock()
        self._seen: float | None = None  # the folder's mtime when last read
        self._hashes: list[tuple[str, str]] = []  # (hash, tenant)

    def tenant(self, key: str | None) -> str | None:
        """The tenant of `key`; raises OpenAIError (401) for a wrong or missing one."""
        if key is None:
            if self.required:
                raise unauthorized(
                    "no API key given: send 'Authorization: Bearer <key>' with "
                    "the key `pensieve tenant add` printed"
                )
            return None
        self._reload()  # one stat a request: a removed or rotated key stops working at once
        found = self._find(_digest(key))
        if found is None and self.required:
            raise unauthorized("Incorrect API key provided")
        return found

    def _find(self, digest: str) -> str | None:
        found = None
        for stored, tenant in self._hashes:  # every one compared: no early exit to time
            if hmac.compare_digest(stored, digest):
                found = tenant
        return found

    def _reload(self) -> bool:
        """Read the hashes again if the folder changed; whether it did."""
        with self._lock:
            try:
                mtime = self.directory.stat().st_mtime
            except FileNotFoundError:
                return False
            if mtime == self._seen:
                return False
            hashes = [
                (path.read_text().strip(), path.name.removesuffix(SUFFIX))
                for path in sorted(self.directory.glob(f"*{SUFFIX}"))
            ]
            self._hashes, self._seen = hashes, mtime
            return True


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()
