"""Ray for `simulate --ray` and `campaign --ray`: one way to connect or start, and to leave the process as found.

`ray.init` installs its own SIGINT/SIGTERM handlers and leaves them after `shutdown`: a library call must give
the caller's back. An instance started here (a local one with `jobs` CPUs) is shut down here; one that was
already running, or a cluster's, is left alone.
"""

from __future__ import annotations

import logging
import signal
from contextlib import contextmanager

RAY_INSTALL = "pip install multispin-testbed[cluster]"


def import_ray(error: type[Exception]):
    """Ray, or `error` naming the extra that installs it."""
    try:
        import ray
    except ImportError:
        raise error(f"--ray needs Ray, which is not installed: {RAY_INSTALL}") from None
    return ray


@contextmanager
def ray_instance(address: str | None, jobs: int, error: type[Exception]):
    """The `ray` module, connected to `address` or to a new local instance with `jobs` CPUs (address empty);
    `error` for a Ray that is missing or does not start."""
    ray = import_ray(error)
    own = not ray.is_initialized()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    if own:
        try:
            if address:
                ray.init(address=address, logging_level=logging.WARNING)
            else:
                ray.init(address="local", num_cpus=jobs, include_dashboard=False, logging_level=logging.WARNING)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise error(f"--ray {address or '(local)'}: Ray did not start or connect: {exc}") from None
    try:
        yield ray
    finally:
        if own:
            ray.shutdown()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
