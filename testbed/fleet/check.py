"""`fleet check`: what a host reports (`probe`), held against this machine (`layout.Local`), as table rows,
each failure with the command or change that fixes it. Pure functions of the reports: `control` gathers them."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from testbed.fleet.clock import ClockSample
from testbed.fleet.layout import DRAFTER, Local, key_dir
from testbed.fleet.schema import Fleet, Host


@dataclass(frozen=True)
class Row:
    host: str
    device: str  # a device name, or the host's devices joined by "," for what they share
    item: str
    ok: bool
    detail: str
    fix: str = ""


def project_rows(host: Host, devices: str, local: Local, project: dict | None, python: str) -> list[Row]:
    install = ("`multispin fleet up` installs it in the host's venv" if host.install == "venv" else
               f"install it for {python} on {host.name}: pip install --no-deps <this project> && "
               "pip install -r requirements-device.txt (or set install: venv)")
    if project is None:
        return [Row(host.name, devices, "project", False, f"{python} is missing on {host.name}", install)]
    if project.get("error"):
        return [Row(host.name, devices, "project", False, f"{python} cannot import the project: "
                                                            f"{project['error']}", install)]
    rows = []
    theirs, ours = (project["version"], project["protocol"]), (local.version, local.protocol)
    detail = f"project {theirs[0]}, protocol {theirs[1]} (here {ours[0]}, protocol {ours[1]})"
    rows.append(Row(host.name, devices, "versions", theirs == ours, detail, "" if theirs == ours else
                    f"install this machine's version on {host.name} (same commit): " + install.split(": ", 1)[-1]))
    if project["missing"]:
        rows.append(Row(host.name, devices, "device requirements", False,
                        "cannot import " + "; ".join(project["missing"]), install))
    return rows


def drafter_row(host: Host, devices: str, local: Local, report: dict, fleet_file: str) -> Row:
    where = f"{report['dir']}/{DRAFTER}"
    if local.drafter_sha is None:
        return Row(host.name, devices, "drafter", False, f"{local.drafter} is missing here",
                   "set `drafter:` to the draft ONNX file (`multispin models info` shows the default pair's)")
    theirs = report["files"].get(DRAFTER)
    if theirs is None:
        return Row(host.name, devices, "drafter", False, f"missing at {where}", f"multispin fleet up {fleet_file}")
    if theirs != local.drafter_sha:
        return Row(host.name, devices, "drafter", False,
                   f"{where}: sha256 {theirs[:12]} differs from {local.drafter.name}'s {local.drafter_sha[:12]}",
                   f"multispin fleet up {fleet_file} (copies the changed file)")
    return Row(host.name, devices, "drafter", True, f"{where} sha256 {theirs[:12]}")


def key_row(host: Host, device: str, local: Local, report: dict, fleet: Fleet, fleet_file: str) -> Row:
    if local.keys_dir is None:
        return Row(host.name, device, "keys", True, "none: the profile must say `security: insecure`")
    ours = {v: k for k, v in local.authorized.items()}.get(device)
    if ours is None:
        return Row(host.name, device, "keys", False, f"{local.keys_dir} admits no device {device!r}",
                   f"multispin keys generate --out {fleet.keys} --force --devices "
                   + ",".join(d for h in fleet.hosts for d in h.devices) + " (then restart the edge)")
    bundle = report["keys"].get(device) or {}
    client, server = bundle.get("client"), bundle.get("server")
    where = f"{report['dir']}/{key_dir(device)}"
    again = f"multispin fleet up {fleet_file} (copies {fleet.keys}/clients/{device}/)"
    if client is None and server is None:
        return Row(host.name, device, "keys", False, f"no key pair at {where}", again)
    if client is None or server is None or not client.get("secret"):
        return Row(host.name, device, "keys", False, f"{where}: key pair incomplete", again)
    if client["public"] != ours:
        whose = local.authorized.get(client["public"])
        said = f"the key of {whose!r}" if whose else "a key the edge does not admit"
        return Row(host.name, device, "keys", False, f"{where} holds {said}, not {device}'s", again)
    if server["public"] != local.server_public:
        return Row(host.name, device, "keys", False, f"{where}/server.key is another key folder's server key", again)
    return Row(host.name, device, "keys", True, f"{where}: {device}'s pair, this edge's server key")


def endpoint_rows(host: Host, devices: str, fleet: Fleet, report: dict) -> list[Row]:
    rows = []
    for label, endpoint in fleet.endpoints().items():
        got = report["endpoints"][label]
        if got["error"] or not got["connect_s"]:
            port = endpoint.rsplit(":", 1)[1]
            start = ("start the edge first (multispin edge --profile PROFILE)" if label == "edge" else
                     "start the edge with channel.mode real|virtual first (it runs the emulator)")
            rows.append(Row(host.name, devices, f"reach {label}", False,
                            f"{endpoint} from {host.name}: {got['error']}",
                            f"{start}; check {label}: in the fleet file and that the edge host's firewall "
                            f"opens port {port}"))
            continue
        times = sorted(got["connect_s"])
        rows.append(Row(host.name, devices, f"reach {label}", True, f"{endpoint} answers"))
        rows.append(Row(host.name, devices, f"link {label}", True,
                        f"TCP connect {1e3 * times[0]:.2f} ms min, {1e3 * statistics.median(times):.2f} ms median "
                        f"({len(times)})"))
    return rows


def clock_row(host: Host, devices: str, fleet: Fleet, sample: ClockSample) -> Row:
    detail = (f"offset {sample.offset_s * 1e3:+.1f} ms ± {sample.uncertainty_s * 1e3:.1f} ms, "
              f"RTT {sample.rtt_s * 1e3:.1f} ms")
    ok = abs(sample.offset_s) - sample.uncertainty_s <= fleet.max_clock_offset_s
    fix = "" if ok else (f"synchronise {host.name}'s clock (and this one's) with NTP: `sudo chronyc makestep` or "
                         f"`sudo timedatectl set-ntp true`; limit max_clock_offset_s={fleet.max_clock_offset_s:g}")
    return Row(host.name, devices, "clock", ok, detail, fix)


def render(rows: list[Row]) -> str:
    """One table: host, device, item, ok/FAIL, detail; each failure's fix on the line under it."""
    heads = ("host", "device", "check", "", "detail")
    cells = [(r.host, r.device, r.item, "ok" if r.ok else "FAIL", r.detail) for r in rows]
    widths = [max(len(c[i]) for c in [heads, *cells]) for i in range(4)]
    line = lambda c: "  ".join(x.ljust(w) for x, w in zip(c[:4], widths)) + "  " + c[4]  # noqa: E731
    out = [line(heads)]
    for row, c in zip(rows, cells):
        out.append(line(c))
        if row.fix:
            out.append(" " * (sum(widths[:2]) + 4) + "fix: " + row.fix)
    failed = sum(not r.ok for r in rows)
    out.append(f"{failed} failure(s)" if failed else "all checks passed")
    return "\n".join(out)
