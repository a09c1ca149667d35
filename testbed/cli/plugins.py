"""`multispin plugins [--json]`: the policies and channel sources a name can pick, built in and installed."""

from __future__ import annotations


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plugins", help="list the policies and channel sources: built in and installed plug-ins",
        description="Built-in policies and channel sources, and the plug-ins installed under the entry-point "
                    "groups multispin.policies and multispin.channels, each loaded and checked against its "
                    "interface (docs/extending.md). A plug-in can also be named by its Python path, "
                    "module:Class, without being installed.")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=run)


def run(args) -> int:
    """Exit status 1 when an installed plug-in does not load or does not satisfy its interface."""
    from testbed.runtime.plugins import CHANNEL_GROUP, POLICY_GROUP, installed
    from testbed.runtime.records import json_text

    found = installed()
    bad = [r for rows in found.values() for r in rows if not r["ok"]]
    if args.json:
        print(json_text(found, indent=2))
        return 1 if bad else 0
    for kind, title, group in (("policies", "policies", POLICY_GROUP), ("channels", "channel sources", CHANNEL_GROUP)):
        print(f"{title} (policy: / --policy)" if kind == "policies" else f"{title} (channel.state.source)")
        rows = found[kind]
        width = max(len(r["name"]) for r in rows) + 2
        for r in rows:
            if r["origin"] == "built in":
                print(f"  {r['name']:<{width}}built in    {r['description']}")
        plugged = [r for r in rows if r["origin"] != "built in"]
        if not plugged:
            print(f"  (no plug-in installed in {group})")
        for r in plugged:
            where = f"{r['target']}" + (f" [{r['distribution']}]" if r.get("distribution") else "")
            state = f"ok          {r['description']}" if r["ok"] else f"NOT USABLE  {r['error']}"
            print(f"  {r['name']:<{width}}{state}\n  {'':<{width}}  from {where}")
    if bad:
        print(f"{len(bad)} installed plug-in(s) not usable (above)")
    return 1 if bad else 0
