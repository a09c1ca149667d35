"""One SSH session with a fleet host (asyncssh): run a command, run the `probe` there, copy a file.

Host keys are checked against the fleet file's `known_hosts` (default ~/.ssh/known_hosts): an unknown host
is refused, never trusted on first use. Every path on the host is absolute, under the fleet folder that the
first `inspect` resolves."""

from __future__ import annotations

import json
import posixpath
import shlex
from pathlib import Path

import asyncssh

from testbed.fleet import probe
from testbed.fleet.schema import Host, local_path

PROBE_SOURCE = Path(probe.__file__).read_text()
CONNECT_TIMEOUT_S = 10.0


class HostError(Exception):
    """A host that cannot be reached or asked; `fix` says what to do."""

    def __init__(self, message: str, fix: str):
        super().__init__(message)
        self.fix = fix


def device_python(host: Host, root: str) -> str:
    """The interpreter that runs the host's devices (and its supervisor)."""
    return posixpath.join(root, "venv", "bin", "python") if host.install == "venv" else host.python


class HostSession:
    def __init__(self, host: Host, base: Path):
        self.host, self.base = host, base
        self.conn: asyncssh.SSHClientConnection | None = None
        self.root: str | None = None  # the fleet folder on the host, absolute

    async def __aenter__(self) -> HostSession:
        h = self.host
        options = {"port": h.port, "connect_timeout": CONNECT_TIMEOUT_S,
                   "known_hosts": None if h.known_hosts is None else str(local_path(self.base, h.known_hosts))}
        if h.user:
            options["username"] = h.user
        if h.client_key:
            options["client_keys"] = [str(local_path(self.base, h.client_key))]
        try:
            self.conn = await asyncssh.connect(h.address, **options)
        except asyncssh.HostKeyNotVerifiable as exc:
            raise HostError(f"host key of {h.address}:{h.port} not verified: {exc}",
                            f"ssh-keyscan -p {h.port} {h.address} >> {h.known_hosts} (after checking "
                            "the fingerprint)") from None
        except asyncssh.PermissionDenied as exc:
            raise HostError(f"SSH login refused: {exc}",
                            f"ssh-copy-id -p {h.port} {h.user or ''}{'@' if h.user else ''}{h.address}, or set "
                            "client_key") from None
        except (OSError, asyncssh.Error, TimeoutError) as exc:
            raise HostError(f"no SSH to {h.address}:{h.port}: {exc}",
                            "check the host is on and its address/port, and that sshd runs") from None
        return self

    async def __aexit__(self, *exc) -> None:
        if self.conn is not None:
            self.conn.close()
            await self.conn.wait_closed()

    def command(self, *argv: str) -> str:
        """A shell line running `argv` with the host's extra environment."""
        env = [f"{k}={v}" for k, v in self.host.env.items()]
        return shlex.join(["env", *env, *argv] if env else list(argv))

    async def run(self, line: str, *, check: bool = True, timeout_s: float = 120.0) -> asyncssh.SSHCompletedProcess:
        result = await self.conn.run(line, check=False, timeout=timeout_s)
        if check and result.exit_status != 0:
            raise HostError(f"`{line[:120]}` exited {result.exit_status}: {str(result.stderr).strip()[-400:]}",
                            "run it on the host by hand to see why")
        return result

    def probe_command(self, python: str, mode: str, *args: str) -> str:
        return self.command(python, "-c", PROBE_SOURCE, mode, *args)

    async def inspect(self, python: str, request: dict) -> dict:
        result = await self.run(self.probe_command(python, "inspect", json.dumps(request)), check=False,
                                timeout_s=120.0 + request.get("wait_s", 0.0))
        if result.exit_status != 0:
            raise HostError(f"{python} on {self.host.name} failed: {str(result.stderr).strip()[-300:]}",
                            f"install Python 3.10+ there, or set hosts[].python (now {self.host.python!r})")
        report = json.loads(str(result.stdout).strip().splitlines()[-1])
        self.root = report["dir"]
        return report

    def path(self, rel: str) -> str:
        return posixpath.join(self.root, rel)

    async def put(self, local: Path, rel: str, mode: int = 0o644) -> None:
        """Copy `local` to the fleet folder's `rel` (through a temporary name: a device never reads half)."""
        target = self.path(rel)
        async with self.conn.start_sftp_client() as sftp:
            await sftp.makedirs(posixpath.dirname(target), exist_ok=True)
            tmp = target + ".part"
            await sftp.put(str(local), tmp)
            await sftp.chmod(tmp, mode)
            await sftp.posix_rename(tmp, target)
