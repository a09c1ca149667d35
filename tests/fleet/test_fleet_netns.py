"""`multispin fleet` against real SSH servers on two "device hosts": network namespaces joined to the test's
namespace by a veth pair each (the test's side of the veth is the "edge host's" address), one asyncssh server
per namespace (tests/fleet/sshd.py: public-key login, known_hosts checked, commands through /bin/sh, SFTP).

Faults are planted the way they happen: files written into a host's folder, a host whose Python imports an
older project (its `env: PYTHONPATH`), an endpoint nothing listens on, and a host clock 2 s ahead (the SSH
server sets MULTISPIN_TEST_CLOCK_SKEW_S for its commands; the host-side clock probe adds it to time.time())."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import asyncssh
import pytest
import yaml
from support import ROOT, wait_until

from testbed.fleet.supervisor import alive
from testbed.runtime.records import load_run
from testbed.runtime.security import generate_keys

pytestmark = [pytest.mark.netns, pytest.mark.live]
PYTHON = sys.executable
WALKTHROUGH = ROOT / "docs" / "lan-walkthrough.md"


def ip(*args: str, check: bool = True) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


class DeviceHost:
    """A network namespace with a veth to the test's namespace, a home folder and an SSH server."""

    def __init__(self, tag: str, index: int, subnet: int, home: Path):
        self.name, self.ns = f"h{index}", f"msfl-{tag}-{index}"
        self.if_out, self.if_in = f"mf{tag}{index}o", f"mf{tag}{index}i"
        self.root_addr, self.addr = f"10.214.{subnet}.1", f"10.214.{subnet}.2"
        self.home, self.server = home, None
        self.host_key = asyncssh.generate_private_key("ssh-ed25519")

    def create(self) -> None:
        done = subprocess.run(["ip", "netns", "add", self.ns], capture_output=True, text=True)
        if done.returncode != 0:
            raise PermissionError(done.stderr.strip())
        ip("link", "add", self.if_out, "type", "veth", "peer", "name", self.if_in)
        ip("link", "set", self.if_in, "netns", self.ns)
        ip("addr", "add", f"{self.root_addr}/24", "dev", self.if_out)
        ip("link", "set", self.if_out, "up")
        for args in (("addr", "add", f"{self.addr}/24", "dev", self.if_in), ("link", "set", self.if_in, "up"),
                     ("link", "set", "lo", "up"), ("route", "add", "default", "via", self.root_addr)):
            ip("-n", self.ns, *args)

    def serve(self, authorized: Path, skew_s: float = 0.0) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        key = self.home.parent / f"{self.name}-host-key"
        self.host_key.write_private_key(str(key))
        log = self.home.parent / f"{self.name}-sshd.log"
        with open(log, "w") as out:
            self.server = subprocess.Popen(
                ["ip", "netns", "exec", self.ns, PYTHON, str(ROOT / "tests" / "fleet" / "sshd.py"), "--listen",
                 self.addr, "--host-key", str(key), "--authorized", str(authorized), "--home", str(self.home),
                 "--clock-skew", str(skew_s)], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        wait_until(lambda: "ready" in log.read_text() or self.server.poll() is not None, 30, "the SSH server")
        assert self.server.poll() is None, log.read_text()

    def known_hosts_line(self) -> str:
        return f"{self.addr} {self.host_key.export_public_key().decode().strip()}\n"

    def close(self) -> None:
        if self.server is not None and self.server.poll() is None:
            self.server.terminate()
            try:
                self.server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait()
        ip("link", "del", self.if_out, check=False)
        ip("netns", "del", self.ns, check=False)


@pytest.fixture
def hosts(tmp_path):
    """Two device hosts; an SSH client key under tmp_path/home/.ssh (the HOME the commands run with)."""
    tag = uuid.uuid4().hex[:4]
    subnet = int(tag[:2], 16) % 120 + 1
    made = [DeviceHost(tag, i, subnet + 120 * (i - 1), tmp_path / f"host{i}") for i in (1, 2)]
    try:
        for h in made:
            h.create()
    except (PermissionError, FileNotFoundError, RuntimeError) as exc:
        for h in made:
            h.close()
        pytest.skip(f"network namespaces are not permitted here: {exc}")
    ssh = tmp_path / "home" / ".ssh"
    ssh.mkdir(parents=True)
    client = asyncssh.generate_private_key("ssh-ed25519")
    client.write_private_key(str(ssh / "id_ed25519"))
    client.write_public_key(str(ssh / "id_ed25519.pub"))
    try:
        yield made
    finally:
        for h in made:
            h.close()


def fleet_cmd(cwd: Path, *args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "testbed.cli", "fleet", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def rows(table: str) -> dict[tuple[str, str, str], tuple[str, str, str]]:
    """(host, device, check) -> (ok/FAIL, detail, fix) from the printed table."""
    out, last = {}, None
    for line in table.splitlines()[1:]:
        if line.strip().startswith("fix: ") and last:
            out[last] = (*out[last][:2], line.strip()[5:])
            continue
        m = re.match(r"(\S+)\s+(\S+)\s+(.+?)\s+(ok|FAIL)\s+(.*)$", line)
        if m:
            last = (m[1], m[2], m[3])
            out[last] = (m[4], m[5], "")
    return out


def free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def test_check_reports_each_planted_fault_with_its_fix(hosts, tmp_path):
    h1, h2 = hosts
    generate_keys(tmp_path / "keys", ["dev0", "dev1"])
    (tmp_path / "home" / ".ssh" / "known_hosts").write_text(h1.known_hosts_line() + h2.known_hosts_line())
    h1.serve(tmp_path / "home" / ".ssh" / "id_ed25519.pub")
    h2.serve(tmp_path / "home" / ".ssh" / "id_ed25519.pub", skew_s=2.0)  # h2's clock: 2 s ahead
    drafter = tmp_path / "draft.onnx"
    drafter.write_bytes(os.urandom(4096))
    # h1: the right drafter, but dev1's key pair where dev0's belongs
    fleet_dir = h1.home / "multispin-fleet"
    shutil.copytree(tmp_path / "keys" / "clients" / "dev1", fleet_dir / "keys" / "dev0")
    shutil.copy(drafter, fleet_dir / "draft.onnx")
    # h2: no drafter, the right keys, and a Python that imports an older project (version and protocol)
    shutil.copytree(tmp_path / "keys" / "clients" / "dev1", h2.home / "multispin-fleet" / "keys" / "dev1")
    old = tmp_path / "old-project" / "testbed"
    (old / "wire").mkdir(parents=True)
    (old / "__init__.py").write_text('__version__ = "0.0.9"\n')
    (old / "wire" / "__init__.py").write_text("")
    (old / "wire" / "protocol.py").write_text("PROTOCOL_VERSION = 0\n")
    edge = socket.socket()  # something answers at the edge endpoint; nothing at the emulator's
    edge.bind((h1.root_addr, 0))
    edge.listen(16)
    host = {"python": PYTHON, "install": "check", "user": "pi"}
    fleet = {"edge": f"tcp://{h1.root_addr}:{edge.getsockname()[1]}",
             "emulator": f"tcp://{h1.root_addr}:{free_port(h1.root_addr)}", "keys": "keys",
             "drafter": "draft.onnx",
             "hosts": [{"name": "h1", "address": h1.addr, "devices": ["dev0"], **host},
                       {"name": "h2", "address": h2.addr, "devices": ["dev1"], **host,
                        "env": {"PYTHONPATH": str(old.parent)}}]}
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(fleet))
    try:
        done = fleet_cmd(tmp_path, "check", "fleet.yaml", env={**os.environ, "HOME": str(tmp_path / "home")})
    finally:
        edge.close()
    print(done.stdout, done.stderr)
    assert done.returncode == 1
    got = rows(done.stdout)
    # wrong key
    ok, detail, fix = got["h1", "dev0", "keys"]
    assert ok == "FAIL" and "holds the key of 'dev1', not dev0's" in detail
    assert fix == "multispin fleet up fleet.yaml (copies keys/clients/dev0/)"
    # missing drafter
    ok, detail, fix = got["h2", "dev1", "drafter"]
    assert ok == "FAIL" and detail.startswith("missing at ") and fix == "multispin fleet up fleet.yaml"
    # version mismatch
    ok, detail, fix = got["h2", "dev1", "versions"]
    assert ok == "FAIL" and "project 0.0.9, protocol 0 (here 0.1.0, protocol 1)" in detail
    assert fix.startswith("install this machine's version on h2")
    # unreachable endpoint, from both hosts
    for name, dev in (("h1", "dev0"), ("h2", "dev1")):
        ok, detail, fix = got[name, dev, "reach emulator"]
        assert ok == "FAIL" and "Connection refused" in detail and "start the edge with channel.mode" in fix
        assert got[name, dev, "reach edge"][0] == "ok" and got[name, dev, "link edge"][0] == "ok"
    # a clock 2 s off, measured within its uncertainty; h1's is not
    ok, detail, fix = got["h2", "dev1", "clock"]
    offset_ms, unc_ms = (float(x) for x in re.match(r"offset ([-+0-9.]+) ms ± ([0-9.]+) ms", detail).groups())
    assert ok == "FAIL" and abs(offset_ms - 2000) <= unc_ms + 1 and "chronyc makestep" in fix
    assert got["h1", "dev0", "clock"][0] == "ok"
    # and what is right is said so
    assert got["h1", "dev0", "drafter"][0] == "ok" and got["h2", "dev1", "keys"][0] == "ok"
    assert got["h1", "dev0", "versions"][0] == "ok"
    # a host whose key is not in known_hosts is refused, not trusted on first use
    (tmp_path / "empty_known_hosts").write_text("")
    unknown = {**fleet, "hosts": [{**fleet["hosts"][0], "known_hosts": "empty_known_hosts"}]}
    (tmp_path / "unknown.yaml").write_text(yaml.safe_dump(unknown))
    done = fleet_cmd(tmp_path, "check", "unknown.yaml", env={**os.environ, "HOME": str(tmp_path / "home")})
    ok, detail, fix = rows(done.stdout)["h1", "dev0", "ssh"]
    assert done.returncode == 1 and ok == "FAIL" and "host key" in detail
    assert fix.startswith(f"ssh-keyscan -p 22 {h1.addr} >> empty_known_hosts")


def walkthrough_commands() -> list[str]:
    """The lines of the walkthrough's bash blocks, in order."""
    blocks = re.findall(r"```bash\n(.*?)```", WALKTHROUGH.read_text(), re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def walkthrough_fleet() -> dict:
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", WALKTHROUGH.read_text(), re.S) if "hosts:" in b]
    return yaml.safe_load(block)


@pytest.mark.slow
def test_the_lan_walkthrough_runs_as_written(hosts, tmp_path):
    """docs/lan-walkthrough.md line by line: fleet up brings both hosts into a run from the fleet file and the
    key folder; fleet down leaves none of the processes it started (checked by pid)."""
    from model_pairs.model_pair import cache_root

    h1, h2 = hosts
    for h in hosts:
        h.serve(tmp_path / "home" / ".ssh" / "id_ed25519.pub")
    work = tmp_path / "edge-host"
    work.mkdir()
    port = free_port(h1.root_addr)
    addresses = {"192.168.1.10:5555": f"{h1.root_addr}:{port}", "192.168.1.21": h1.addr, "192.168.1.22": h2.addr}

    def local(text: str) -> str:
        for doc, real in addresses.items():
            text = text.replace(doc, real)
        return text

    fleet = yaml.safe_load(local(yaml.safe_dump(walkthrough_fleet())))
    for host in fleet["hosts"]:
        host.update(python=PYTHON, install="check")  # the one change (the doc says so): this Python
    (work / "fleet.yaml").write_text(yaml.safe_dump(fleet))
    env = {**os.environ, "HOME": str(tmp_path / "home"), "MULTISPIN_CACHE": str(cache_root())}
    commands = walkthrough_commands()
    assert [c.split()[1] if c.startswith("multispin") else c.split()[0] for c in commands] == [
        "ssh-keyscan", "keys", "fleet", "edge", "fleet", "fleet", "runs", "report"], commands
    started: list[subprocess.Popen] = []

    def run(line: str, expect: int = 0) -> str:
        done = subprocess.run(local(line), shell=True, cwd=work, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == expect, (line, done.stdout, done.stderr)
        return done.stdout

    def background(line: str) -> tuple[subprocess.Popen, Path]:
        out = tmp_path / f"out-{len(started)}.log"
        with open(out, "w") as f:
            proc = subprocess.Popen(shlex.split(local(line)), cwd=work, env=env, stdout=f, stderr=subprocess.STDOUT)
        started.append(proc)
        return proc, out

    try:
        keyscan, keys, check, edge_line, up_line, down, runs, report = commands
        run(keyscan)
        assert (tmp_path / "home" / ".ssh" / "known_hosts").read_text().count("ssh-ed25519") == 2
        run(keys)
        before = rows(run(check, expect=1))  # clean hosts: nothing copied, no edge yet
        for name, dev in (("pi-a", "dev0"), ("pi-b", "dev1")):
            assert before[name, dev, "drafter"][0] == before[name, dev, "keys"][0] == "FAIL"
            assert before[name, dev, "reach edge"][0] == "FAIL" and before[name, dev, "clock"][0] == "ok"
        edge, edge_out = background(edge_line)
        wait_until(lambda: "edge at" in edge_out.read_text() or edge.poll() is not None, 120, "the edge binding")
        up, up_out = background(up_line)
        wait_until(lambda: edge.poll() is not None or up.poll() is not None, 240, "the run's end")
        assert edge.returncode == 0, edge_out.read_text()[-3000:]
        wait_until(lambda: "pi-b/dev1 | " in up_out.read_text() and "pi-a/dev0 | " in up_out.read_text(), 30,
                   "both hosts' device logs, prefixed")
        up.send_signal(signal.SIGINT)  # Ctrl-C: stop following; the devices keep running
        assert up.wait(timeout=30) == 0
        text = up_out.read_text()
        assert "stopped following; the devices keep running" in text
        assert "all checks passed" in text and "pi-a: copied draft.onnx, keys/dev0/client.key" in text
        pids = {}
        for name, h in (("pi-a", h1), ("pi-b", h2)):
            pid_file = json.loads((h.home / "multispin-fleet" / "run" / "supervisor.pid").read_text())
            pids[name] = [pid_file["pid"], *pid_file["devices"].values()]
            assert len(pids[name]) == 2 and all(alive(p) for p in pids[name])
        stopped = run(down)
        for name in pids:
            assert f"{name}: stopped supervisor (pid {pids[name][0]})" in stopped, stopped
            assert not any(alive(p) for p in pids[name])
        again = run(down)  # a second down: nothing of up is left to stop
        assert "pi-a: nothing running" in again and "pi-b: nothing running" in again
        assert "edge-proposed" in run(runs)
        (run_dir,) = (work / "runs").iterdir()
        meta, records = load_run(run_dir)
        assert meta["status"] == "complete" and len(records) == 8
        assert all(set(r["devices"]) == {"dev0", "dev1"} for r in records)  # both hosts' devices, every round
        shown = run(report)
        assert "dev0" in shown and "dev1" in shown
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for h in hosts:
            spec = h.home / "multispin-fleet" / "run" / "supervisor.json"
            if spec.is_file():  # a failed test still stops what `up` started
                subprocess.run([PYTHON, "-m", "testbed.fleet.supervisor", "--stop", str(spec)], cwd=ROOT,
                               capture_output=True, timeout=60)
