"""`multispin channel`: run the channel emulator standalone (`serve`), validate it on real messages, or measure
a real link (`probe`)."""

from __future__ import annotations

import argparse
import sys

from channel_emulator import DEFAULT_SPIN_S
from testbed.runtime.records import json_text


def _floats(field: str):
    def parse(text: str) -> list[float]:
        try:
            values = [float(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--{field}={text!r}: expected comma-separated numbers, e.g. 100,1e3") from None
        if not values or any(not v > 0 for v in values):
            raise argparse.ArgumentTypeError(f"--{field}={text!r}: every value must be > 0")
        return values
    return parse


def register(subparsers) -> None:
    p = subparsers.add_parser("channel", help="the channel emulator: serve it, validate it")
    sub = p.add_subparsers(dest="channel_command", metavar="SUBCOMMAND")
    sub.required = True

    v = sub.add_parser("validate", help="achieved vs configured air time through a real emulator process")
    v.add_argument("--sizes", type=_floats("sizes"), default=None,
                   help="payload sizes in bytes (default 100,1e3,1e4,1e5,1e6,1e7)")
    v.add_argument("--rates", type=_floats("rates"), default=None,
                   help="rates in bit/s (default 0.1e6,1e6,10e6,100e6)")
    v.add_argument("--repeats", type=int, default=None,
                   help="messages per cell (default: 21 for cells under 0.1 s, 5 otherwise)")
    v.add_argument("--mode", choices=["real", "virtual"], default="real")
    v.add_argument("--max-modeled-s", type=float, default=3.0, help="skip cells whose air time exceeds this")
    v.add_argument("--spin-s", type=float, default=DEFAULT_SPIN_S, help="the emulator's busy-wait window (s)")
    v.add_argument("--lead", default="auto",
                   help="'auto' (calibrate the transport time outside the hold first), or 'A,B': release "
                        "A + B*bytes seconds early ('0,0': no compensation)")
    v.add_argument("--no-marker", action="store_true", help="do not send tx_start markers")
    v.add_argument("--json", action="store_true", help="print JSON instead of a table")
    v.set_defaults(handler=_validate)

    s = sub.add_parser("serve", help="run the emulator standalone (e.g. between LAN devices and the edge)")
    s.add_argument("--frontend", required=True, help="bind endpoint for devices, e.g. tcp://0.0.0.0:5600")
    s.add_argument("--edge", required=True, help="the edge ROUTER to connect to, e.g. tcp://edge-host:5555")
    s.add_argument("--control", required=True, help="bind endpoint of the control REP, e.g. tcp://0.0.0.0:5601")
    s.add_argument("--mode", choices=["real", "virtual"], default="real",
                   help="real: hold messages for their air time; virtual: forward at once, annotate only")
    s.add_argument("--spin-s", type=float, default=DEFAULT_SPIN_S, help="busy-wait window before a deadline (s)")
    s.add_argument("--marker-ttl-s", type=float, default=5.0, help="ignore tx_start markers older than this")
    s.add_argument("--keys", default=None, metavar="DIR",
                   help="key directory (multispin keys generate): CURVE on the frontend, control and edge links; "
                        "without it, set MULTISPIN_CHANNEL_TOKEN to require a token on the control socket")
    s.add_argument("--insecure", action="store_true",
                   help="serve a non-loopback --frontend without --keys, or a non-loopback --control without "
                        "--keys or MULTISPIN_CHANNEL_TOKEN: any peer that reaches the port is accepted (a "
                        "SECURITY warning is logged)")
    s.set_defaults(handler=_serve)

    pr = sub.add_parser("probe", help="measure a real link's rate, latency and jitter (size-swept ping-pong)",
                        description="Run the echo server on one end (--serve) and measure from the other "
                                    "(--connect): upload and download rates from the slope of round trip "
                                    "against size, latency and jitter from tiny echoes. No clock sync needed.")
    g = pr.add_mutually_exclusive_group(required=True)
    g.add_argument("--connect", metavar="tcp://HOST:PORT", help="measure the link to this probe server")
    g.add_argument("--serve", metavar="tcp://0.0.0.0:PORT", help="run the echo server here")
    pr.add_argument("--once", action="store_true", help="--serve: exit after the first client disconnects")
    pr.add_argument("--direction", choices=["both", "up", "down"], default="both",
                    help="which rates to measure (up: this host to the server)")
    pr.add_argument("--target-s", type=float, default=0.25,
                    help="grow the transfer size until one round trip takes this long (s)")
    pr.add_argument("--repeats", type=int, default=3, help="round trips per size")
    pr.add_argument("--points", type=int, default=5, help="sizes per direction, from a quarter of the top to it")
    pr.add_argument("--pings", type=int, default=20, help="tiny echoes for latency and jitter")
    pr.add_argument("--max-bytes", type=int, default=64 * 2 ** 20, help="largest transfer (bytes)")
    pr.add_argument("--budget-s", type=float, default=30.0, help="time budget of the rate sweeps (s)")
    pr.add_argument("--timeout-s", type=float, default=10.0, help="socket timeout (s)")
    pr.add_argument("--out", help="also write the result as JSON to this file")
    pr.add_argument("--json", action="store_true", help="print JSON instead of a summary")
    pr.set_defaults(handler=_probe)


def _validate(args) -> int:
    from channel_emulator import validate
    from testbed.cli import CliError
    from testbed.runtime import host_load

    if args.repeats is not None and args.repeats < 1:
        raise CliError(f"--repeats={args.repeats}: allowed: an integer >= 1")
    if args.lead == "auto":
        lead = "auto"
    else:
        try:
            a, b = (float(x) for x in args.lead.split(","))
        except ValueError:
            raise CliError(
                f"--lead={args.lead!r}: allowed: 'auto' or two numbers 'A,B' (seconds, seconds/byte)") from None
        lead = (a, b)
    sizes = [int(x) for x in (args.sizes or validate.DEFAULT_SIZES)]
    rates = args.rates or validate.DEFAULT_RATES

    def progress(i, n, cell):
        what = "skipped" if cell.skipped else f"median err {100 * cell.summary()['median_error']:+.3f}%"
        print(f"[{i}/{n}] {cell.size} B at {cell.rate_bps / 1e6:g} Mbit/s: {what}", file=sys.stderr, flush=True)

    load_before, cpu_before = host_load.wakeup_delays(), host_load.cpu_snapshot()  # how busy the host is
    try:
        cells, lead_info = validate.run_validation(sizes=sizes, rates=rates, repeats=args.repeats, mode=args.mode,
                                                   max_modeled_s=args.max_modeled_s, spin_s=args.spin_s,
                                                   use_marker=not args.no_marker, lead=lead, progress=progress)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    share = host_load.others_share(cpu_before, host_load.cpu_snapshot())
    load_after = host_load.wakeup_delays()
    host = {"wakeup_before": load_before.to_dict(), "wakeup_after": load_after.to_dict(),
            "others_cpu_share_during": share}
    if args.json:
        print(json_text({"mode": args.mode, "lead": lead_info, "cells": [c.summary() for c in cells],
                         "host": host}, indent=1))
    else:
        if args.mode == "virtual":  # nothing is held, so no transport lead applies
            print("mode virtual; no lead (messages are forwarded at once and only annotated)")
        else:
            print(f"mode {args.mode}; lead {1e3 * lead_info['lead_s']:.3f} ms + "
                  f"{1e9 * lead_info['lead_per_byte_s']:.3f} ns/byte"
                  + (" (calibrated)" if lead == "auto" else ""))
        print(validate.format_table(cells))
    if not any(not c.skipped and c.in_target_scope for c in cells):
        # Status 1 although nothing missed: say why, or "0/0 cells meet it" reads like a pass.
        print(f"multispin channel: nothing validated: every measured cell's modeled air time is below "
              f"{1000 * validate.TARGET_MIN_MODELED_S:g} ms, where the host's clock, not the emulator, sets the error; "
              f"add larger --sizes or lower --rates (exit status 1)", file=sys.stderr)
    status = validate.exit_status(cells)  # non-zero when a measured cell misses the target
    if status and args.mode == "real":  # a miss on a busy host: say so, with the figures
        missed = [c for c in cells if not c.skipped and c.in_target_scope and not c.summary()["meets_target"]]
        hint = host_load.busy_hint([validate.TARGET_MEDIAN_ERROR * c.modeled_s for c in missed], load_before,
                                   share, load_after)
        if hint:
            print(f"multispin channel: {hint}", file=sys.stderr)
    return status


def _serve(args) -> int:
    import os

    from channel_emulator.proxy import TOKEN_ENV, run_proxy
    from testbed.cli import CliError
    from testbed.runtime.security import SecurityError, require_keys_or_insecure

    # Before any socket: the frontend hands any peer's messages to the edge as a device's (keys only), the
    # control socket takes `stop` (keys, or a token); beyond the loopback either needs --insecure otherwise.
    token = bool(os.environ.get(TOKEN_ENV))
    try:
        require_keys_or_insecure([args.frontend] if token else [args.frontend, args.control], args.keys,
                                 args.insecure, "the emulator", keys_setting="--keys DIR",
                                 insecure_setting="--insecure")
    except SecurityError as exc:
        raise CliError(f"{exc}" + (f" ({TOKEN_ENV} guards --control only)" if token else "")) from None
    print(f"channel emulator ({args.mode}): devices -> {args.frontend}, edge at {args.edge}, "
          f"control at {args.control}", file=sys.stderr, flush=True)
    try:
        run_proxy(args.frontend, args.edge, args.control, mode=args.mode, spin_s=args.spin_s,
                  marker_ttl_s=args.marker_ttl_s, keys_dir=args.keys)
    except SecurityError as exc:
        raise CliError(f"--keys: {exc}") from None
    return 0


def _probe(args) -> int:
    from channel_emulator import link_probe
    from testbed.cli import CliError

    try:
        if args.serve:
            def ready(server):
                print(f"link probe server on {args.serve} (port {server.port}); Ctrl-C stops it",
                      file=sys.stderr, flush=True)
            link_probe.serve(args.serve, once=args.once, ready=ready)
            return 0
        dirs = ("up", "down") if args.direction == "both" else (args.direction,)
        res = link_probe.run_probe(args.connect, directions=dirs, target_s=args.target_s, repeats=args.repeats,
                                   points=args.points, pings=args.pings, max_bytes=args.max_bytes,
                                   budget_s=args.budget_s, timeout_s=args.timeout_s,
                                   progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    except (ValueError, link_probe.ProbeError) as exc:
        raise CliError(str(exc)) from None
    except OSError as exc:  # e.g. the --serve port is taken
        raise CliError(f"{args.serve or args.connect}: {exc.strerror or exc}") from None
    if args.out:
        from pathlib import Path

        Path(args.out).write_text(json_text(res, indent=1) + "\n")
    print(json_text(res, indent=1) if args.json else link_probe.format_result(res))
    return 0
