"""Two network namespaces joined by a veth pair: a stand-in for two hosts (used by tests and tc measurements).

The addresses (10.203.<n>.1 and .2) exist only inside the namespaces; everything is removed by ``close``.
Needs CAP_NET_ADMIN (root); ``VethPair.create`` raises ``PermissionError`` with the reason otherwise.
"""

from __future__ import annotations

import subprocess
import uuid


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc


class VethPair:
    def __init__(self, tag: str, subnet: int):
        self.ns_a, self.ns_b = f"ms-{tag}-a", f"ms-{tag}-b"
        self.if_a, self.if_b = f"ms{tag}a", f"ms{tag}b"
        self.addr_a, self.addr_b = f"10.203.{subnet}.1", f"10.203.{subnet}.2"
        self._made: list[str] = []

    @classmethod
    def create(cls, subnet: int | None = None) -> VethPair:
        tag = uuid.uuid4().hex[:6]
        pair = cls(tag, subnet if subnet is not None else int(tag[:2], 16) % 250 + 1)
        try:
            pair._setup()
        except Exception:
            pair.close()
            raise
        return pair

    def _setup(self) -> None:
        made = _ip("netns", "add", self.ns_a, check=False)
        if made.returncode != 0:
            raise PermissionError(f"cannot create network namespaces here: {made.stderr.strip()}")
        self._made.append(self.ns_a)
        _ip("netns", "add", self.ns_b)
        self._made.append(self.ns_b)
        # Create the pair inside ns_a, then move one end: nothing ever appears in the host namespace for long.
        _ip("-n", self.ns_a, "link", "add", self.if_a, "type", "veth", "peer", "name", self.if_b)
        _ip("-n", self.ns_a, "link", "set", self.if_b, "netns", self.ns_b)
        for ns, ifname, addr in ((self.ns_a, self.if_a, self.addr_a), (self.ns_b, self.if_b, self.addr_b)):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", ifname)
            _ip("-n", ns, "link", "set", ifname, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def exec_args(self, ns: str, *cmd: str) -> list[str]:
        return ["ip", "netns", "exec", ns, *cmd]

    def close(self) -> None:
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)  # deleting a namespace removes its veth end and the peer
        self._made.clear()

    def __enter__(self) -> VethPair:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
