"""`multispin keys generate --out DIR --devices dev0,dev1`: CURVE keys for a LAN deployment."""

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


def generate(args) -> int:
    from testbed.runtime.errors import TestbedError
    from testbed.runtime.security import SecurityError, generate_keys

    names = [n.strip() for n in args.devices.split(",") if n.strip()]
    if not names:
        raise TestbedError("--devices: name at least one device")
    try:
        paths = generate_keys(args.out, names, force=args.force)
    except SecurityError as exc:
        raise TestbedError(str(exc)) from None
    print(f"wrote {args.out}: server key pair, {len(names)} device(s) + edge + channel clients")
    print("on the edge host: set `security: {keys: " + str(args.out) + "}` in the profile")
    for name in names:
        print(f"  copy {paths[name]}/ to device {name}; there: multispin device --keys <that folder> ...")
    return 0
