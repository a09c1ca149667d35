"""A real SSH server for the fleet tests (asyncssh): public-key login, exec of any command through /bin/sh
in a subprocess, SFTP on the local file system. Run inside a network namespace it is a "device host":

    python tests/fleet/sshd.py --listen ADDR --port 22 --host-key KEY --authorized PUB --home DIR [--clock-skew S]

--clock-skew sets MULTISPIN_TEST_CLOCK_SKEW_S in every command's environment: the fleet's clock probe adds it
to the host's time (how the tests plant a clock offset). Prints "ready" once listening; stops on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

import asyncssh


async def feed(channel, pipe) -> None:
    """The client's stdin to the command's, then EOF: a command reading stdin ends when the channel does."""
    try:
        while data := await channel.read(65536):
            pipe.write(data)
            await pipe.drain()
    except (OSError, asyncssh.Error):
        pass
    finally:
        pipe.close()


async def copy(pipe, channel) -> None:
    while data := await pipe.read(65536):
        try:
            channel.write(data)
        except (OSError, asyncssh.Error):
            pass  # the client left: keep draining so the command is not blocked on a full pipe


async def serve(args) -> None:
    env = {**os.environ, "HOME": args.home}
    if args.clock_skew:
        env["MULTISPIN_TEST_CLOCK_SKEW_S"] = str(args.clock_skew)

    async def run_command(process: asyncssh.SSHServerProcess) -> None:
        local = await asyncio.create_subprocess_shell(
            process.command or "true", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=env, cwd=args.home)
        feeding = asyncio.create_task(feed(process.stdin, local.stdin))
        await asyncio.gather(copy(local.stdout, process.stdout), copy(local.stderr, process.stderr))
        code = await local.wait()
        feeding.cancel()
        process.exit(code)

    await asyncssh.create_server(
        None, args.listen, args.port, server_host_keys=[args.host_key], authorized_client_keys=args.authorized,
        process_factory=run_command, encoding=None, sftp_factory=True, allow_scp=False)
    print("ready", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()


def main() -> int:
    p = argparse.ArgumentParser()
    for flag in ("--listen", "--host-key", "--authorized", "--home"):
        p.add_argument(flag, required=True)
    p.add_argument("--port", type=int, default=22)
    p.add_argument("--clock-skew", type=float, default=0.0)
    args = p.parse_args()
    for name in ("host_key", "authorized", "home"):
        setattr(args, name, os.path.abspath(getattr(args, name)))
    os.chdir(args.home)
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
