"""`fleet check|up|down`: the hosts in parallel, one SSH session each.

up = connect, make or check the host's Python, copy what changed, check everything (the `check` table), and
only when nothing failed start each host's `supervisor`; `--follow` then streams the devices' logs, each line
prefixed with host/device. down = stop exactly the supervisor (and its devices) named by the pid file."""

from __future__ import annotations

import asyncio
import json
import posixpath
import shlex
import sys
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

import asyncssh

from testbed.fleet import clock
from testbed.fleet.check import Row, clock_row, drafter_row, endpoint_rows, key_row, project_rows, render
from testbed.fleet.install import ensure_venv
from testbed.fleet.layout import DRAFTER, LOG_DIR, PID_FILE, SPEC, Local, key_dir, local_facts, sha256_file
from testbed.fleet.remote import HostError, HostSession, device_python
from testbed.fleet.schema import Fleet, Host, endpoint_host_port

START_WAIT_S = 15.0


@dataclass
class Fleetwide:
    fleet: Fleet
    base: Path
    fleet_file: str
    local: Local | None  # None for `down`, which compares nothing

    @classmethod
    def load(cls, fleet: Fleet, base: Path, fleet_file: str, compare: bool = True) -> Fleetwide:
        return cls(fleet, base, fleet_file, local_facts(fleet, base) if compare else None)


def inspect_request(fw: Fleetwide, host: Host, wait_s: float = 0.0) -> dict:
    return {"dir": host.dir, "wait_s": wait_s, "files": {rel: rel for rel in fw.local.uploads(host.devices)},
            "keys": {d: key_dir(d) for d in host.devices}, "probes": fw.fleet.min_endpoint_checks,
            "endpoints": {label: endpoint_host_port(ep) for label, ep in fw.fleet.endpoints().items()}}


async def project_report(session: HostSession, python: str) -> dict | None:
    result = await session.run(session.probe_command(python, "project"), check=False)
    if result.exit_status != 0:
        return None  # no such interpreter (a venv not made yet)
    return json.loads(str(result.stdout).strip().splitlines()[-1])


async def host_rows(fw: Fleetwide, session: HostSession, wait_s: float = 0.0) -> list[Row]:
    host, devices = session.host, ",".join(session.host.devices)
    report = await session.inspect(host.python, inspect_request(fw, host, wait_s))
    python = device_python(host, report["dir"])
    rows = project_rows(host, devices, fw.local, await project_report(session, python), python)
    rows.append(drafter_row(host, devices, fw.local, report, fw.fleet_file))
    rows += [key_row(host, d, fw.local, report, fw.fleet, fw.fleet_file) for d in host.devices]
    rows += endpoint_rows(host, devices, fw.fleet, report)
    rows.append(clock_row(host, devices, fw.fleet, await clock.measure(session, host.python)))
    return rows


async def sync(fw: Fleetwide, session: HostSession) -> list[str]:
    """Copy the drafter and the host's key bundles where the host's sha256 differs; the paths copied."""
    host = session.host
    report = await session.inspect(host.python, inspect_request(fw, host))
    copied = []
    for rel, (path, mode) in fw.local.uploads(host.devices).items():
        if report["files"].get(rel) != sha256_file(path):
            await session.put(path, rel, mode)
            copied.append(rel)
    if host.install == "venv":
        project = await project_report(session, device_python(host, report["dir"]))
        mine = {"version": fw.local.version, "protocol": fw.local.protocol}
        if project is None or project.get("error") or project["missing"] or \
                {k: project.get(k) for k in mine} != mine:
            print(f"{host.name}: installing the device requirements and this project in {report['dir']}/venv "
                  "(pip; minutes the first time)", flush=True)
            await ensure_venv(session, host)
            copied.append("venv/ (device requirements and this project)")
    return copied


async def open_sessions(fw: Fleetwide, stack: AsyncExitStack) -> tuple[dict[str, HostSession], list[Row]]:
    async def one(host):
        try:
            return await stack.enter_async_context(HostSession(host, fw.base))
        except HostError as exc:
            return Row(host.name, ",".join(host.devices), "ssh", False, str(exc), exc.fix)

    got = await asyncio.gather(*(one(h) for h in fw.fleet.hosts))
    return ({s.host.name: s for s in got if isinstance(s, HostSession)}, [r for r in got if isinstance(r, Row)])


async def all_rows(fw: Fleetwide, sessions: dict[str, HostSession], wait_s: float = 0.0) -> list[Row]:
    async def one(session):
        try:
            return await host_rows(fw, session, wait_s)
        except HostError as exc:
            return [Row(session.host.name, ",".join(session.host.devices), "probe", False, str(exc), exc.fix)]

    return [r for rows in await asyncio.gather(*(one(s) for s in sessions.values())) for r in rows]


async def check(fw: Fleetwide) -> int:
    async with AsyncExitStack() as stack:
        sessions, rows = await open_sessions(fw, stack)
        rows += await all_rows(fw, sessions)
    print(render(sorted(rows, key=lambda r: r.host)), flush=True)
    return 1 if any(not r.ok for r in rows) else 0


def supervisor_spec(fw: Fleetwide, session: HostSession) -> dict:
    host, root = session.host, session.root
    python, opts = device_python(host, root), fw.fleet.device
    devices = []
    for name in host.devices:
        argv = [python, "-m", "device_node.node", "--connect", fw.fleet.connect, "--name", name,
                "--draft", session.path(DRAFTER), "--register-timeout", f"{opts.register_timeout_s:g}",
                "--link-probe", opts.link_probe]
        argv += ["--keys", session.path(key_dir(name))] if fw.fleet.keys else []
        argv += ["--reconnect"] if opts.reconnect else []
        argv += ["--hardware", host.hardware] if host.hardware else []
        devices.append({"name": name, "argv": argv})
    return {"pid_file": session.path(PID_FILE), "log_dir": session.path(LOG_DIR), "env": host.env,
            "devices": devices}


async def stop_host(session: HostSession) -> dict:
    python = device_python(session.host, session.root)
    line = session.command(python, "-m", "testbed.fleet.supervisor", "--stop", session.path(SPEC))
    result = await session.run(f"test -f {shlex.quote(session.path(SPEC))} || exit 0; {line}")
    out = str(result.stdout).strip()
    return json.loads(out.splitlines()[-1]) if out else {"running": False, "stopped": {}}


async def log_sizes(sftp, session: HostSession) -> dict[str, int]:
    """Where this `up`'s lines begin in each device log (they are appended across starts)."""
    sizes = {}
    for device in session.host.devices:
        try:
            sizes[device] = (await sftp.stat(session.path(f"{LOG_DIR}/{device}.log"))).size or 0
        except asyncssh.SFTPError:
            sizes[device] = 0
    return sizes


async def start_host(fw: Fleetwide, session: HostSession) -> tuple[dict, dict[str, int]]:
    """Start the host's supervisor (stopping one `up` left running first); its pid file's contents and where
    its devices' lines start in their logs."""
    previous = await stop_host(session)
    if previous["running"]:
        print(f"{session.host.name}: stopped the supervisor a previous `up` left running", flush=True)
    spec = supervisor_spec(fw, session)
    async with session.conn.start_sftp_client() as sftp:
        for folder in (posixpath.dirname(SPEC), LOG_DIR):
            await sftp.makedirs(session.path(folder), exist_ok=True)
        async with sftp.open(session.path(SPEC), "w") as f:
            await f.write(json.dumps(spec, indent=1))
        sizes = await log_sizes(sftp, session)
        launch = session.command(device_python(session.host, session.root), "-m", "testbed.fleet.supervisor",
                                 session.path(SPEC))
        log = shlex.quote(session.path(f"{LOG_DIR}/supervisor.log"))
        await session.run(f"cd {shlex.quote(session.root)} && nohup {launch} > {log} 2>&1 < /dev/null &")
        loop = asyncio.get_running_loop()
        end = loop.time() + START_WAIT_S
        while loop.time() < end:
            try:
                async with sftp.open(session.path(PID_FILE)) as f:
                    pids = json.loads(await f.read())
                if len(pids["devices"]) == len(spec["devices"]):
                    return pids, sizes
            except (OSError, ValueError, asyncssh.SFTPError):
                pass  # not written yet
            await asyncio.sleep(0.1)
    log = await session.run(f"tail -n 20 {shlex.quote(session.path(LOG_DIR + '/supervisor.log'))}", check=False)
    raise HostError(f"the supervisor on {session.host.name} did not start: {str(log.stdout).strip()}",
                    "see the log above")


async def follow(sessions: dict[str, HostSession], offsets: dict[str, dict[str, int]]) -> None:
    async def one(session):
        files = {d: [session.path(f"{LOG_DIR}/{d}.log"), offsets[session.host.name][d]] for d in session.host.devices}
        python = session.host.python
        async with session.conn.create_process(session.probe_command(python, "follow", json.dumps(files))) as proc:
            async for line in proc.stdout:
                device, _, text = line.rstrip("\n").partition("\t")
                print(f"{session.host.name}/{device} | {text}", flush=True)

    await asyncio.gather(*(one(s) for s in sessions.values()))


async def up(fw: Fleetwide, follow_logs: bool) -> int:
    async with AsyncExitStack() as stack:
        sessions, rows = await open_sessions(fw, stack)
        copied = await asyncio.gather(*(sync(fw, s) for s in sessions.values()))
        for session, paths in zip(sessions.values(), copied):
            print(f"{session.host.name}: copied {', '.join(paths)}" if paths else
                  f"{session.host.name}: files up to date", flush=True)
        if fw.fleet.wait_for_endpoints_s:
            print(f"checking; waiting up to {fw.fleet.wait_for_endpoints_s:g} s for "
                  + " and ".join(fw.fleet.endpoints().values()) + " to answer", flush=True)
        rows += await all_rows(fw, sessions, fw.fleet.wait_for_endpoints_s)
        print(render(sorted(rows, key=lambda r: r.host)), flush=True)
        if any(not r.ok for r in rows):
            print("nothing started: fix the failures above, then run `multispin fleet up` again", file=sys.stderr)
            return 1
        started = await asyncio.gather(*(start_host(fw, s) for s in sessions.values()))
        for session, (pids, _) in zip(sessions.values(), started):
            devices = ", ".join(f"{n} (pid {p})" for n, p in pids["devices"].items())
            print(f"{session.host.name}: supervisor pid {pids['pid']}: {devices}", flush=True)
        if follow_logs:
            await follow(sessions, {s.host.name: sizes for s, (_, sizes) in zip(sessions.values(), started)})
    return 0


async def down(fw: Fleetwide) -> int:
    async with AsyncExitStack() as stack:
        sessions, rows = await open_sessions(fw, stack)
        for row in rows:
            print(f"{row.host}: {row.detail} (fix: {row.fix})", file=sys.stderr)
        failed = bool(rows)
        for session in sessions.values():
            report = await session.inspect(session.host.python, {"dir": session.host.dir})
            session.root = report["dir"]
        for session, result in zip(sessions.values(), await asyncio.gather(*(stop_host(s) for s in
                                                                              sessions.values()))):
            if not result["running"]:
                print(f"{session.host.name}: nothing running", flush=True)
                continue
            stopped = result["stopped"]
            left = [f"{n} (pid {v['pid']})" for n, v in stopped.items() if not v["gone"]]
            failed |= bool(left)
            print(f"{session.host.name}: stopped " + ", ".join(f"{n} (pid {v['pid']})" for n, v in stopped.items())
                  + (f"; STILL RUNNING: {', '.join(left)}" if left else ""), flush=True)
    return 1 if failed else 0
