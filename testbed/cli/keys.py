"""`multispin keys generate|add|revoke`: CURVE keys for a LAN deployment.

`generate --out DIR --devices dev0,dev1` writes a fresh key directory; `add --keys DIR --devices dev2` gives new
devices keys in it (the others keep theirs); `revoke --keys DIR --devices dev1` takes a device's keys out. A
name given twice, an invalid or reserved name, a name `add` finds already there or `revoke` does not find: exit
2, naming it."""

from __future__ import annotations


def register(subparsers) -> None:
    p = subparsers.add_parser("keys", help="CURVE keys: authenticated, encrypted links on a LAN",
                              description="Make the key directory the edge, the emulator and each device use.")
    sub = p.add_subparsers(dest="keys_command", metavar="ACTION")
    sub.required = True
    g = sub.add_parser("generate", help="write a server pair and one client pair per device")
    g.add_argument("--out", required=True, help="key directory to write (kept on the edge host)")
    g.add_argument("--devices", required=True, help="comma-separated device names, as in the profile")
    g.add_argument("--force", action="store_true", help="replace existing keys (locks out every old device)")
    g.set_defaults(handler=generate)
    a = sub.add_parser("add", help="give new devices keys in an existing key directory")
    a.add_argument("--keys", required=True, metavar="DIR", help="the key directory (`keys generate --out`)")
    a.add_argument("--devices", required=True, help="comma-separated names of devices it has no keys for yet")
    a.set_defaults(handler=add)
    r = sub.add_parser("revoke", help="take devices' keys out of a key directory (the edge refuses them once "
                                      "restarted)")
    r.add_argument("--keys", required=True, metavar="DIR", help="the key directory (`keys generate --out`)")
    r.add_argument("--devices", required=True, help="comma-separated names of devices it has keys for")
    r.set_defaults(handler=revoke)


def _names(text: str) -> list[str]:
    from testbed.runtime.errors import TestbedError

    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise TestbedError("--devices: name at least one device")
    return names


def _run(action, *args):
    from testbed.runtime.errors import TestbedError
    from testbed.runtime.security import SecurityError

    try:
        return action(*args)
    except SecurityError as exc:
        about_names = str(exc).startswith(("client name", "device names"))
        raise TestbedError(f"--devices: {exc}" if about_names else str(exc)) from None


def _say_copy(paths: dict, names: list[str]) -> None:
    for name in names:
        print(f"  copy {paths[name]}/ to device {name}; there: multispin device --keys <that folder> --name "
              f"{name} ...")


def generate(args) -> int:
    from testbed.runtime.security import generate_keys

    names = _names(args.devices)
    paths = _run(lambda: generate_keys(args.out, names, force=args.force))
    print(f"wrote {args.out}: server key pair, {len(names)} device(s) + edge + channel clients")
    print("on the edge host: set `security: {keys: " + str(args.out) + "}` in the profile")
    _say_copy(paths, names)
    return 0


def add(args) -> int:
    from testbed.runtime.security import add_devices

    names = _names(args.devices)
    paths = _run(add_devices, args.keys, names)
    print(f"added {len(names)} device(s) to {args.keys}; restart the edge to admit them")
    _say_copy(paths, names)
    return 0


def revoke(args) -> int:
    from testbed.runtime.security import revoke_devices

    names = _names(args.devices)
    _run(revoke_devices, args.keys, names)
    print(f"revoked {', '.join(names)} in {args.keys}; the edge refuses their keys from its next start")
    return 0
