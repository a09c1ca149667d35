"""Multi-SPIN testbed: the pure core (`testbed.core`), the wire (`testbed.wire`) and the runtime face
(profiles, controller, launcher, records, reports, the `multispin` command line)."""

from pathlib import Path

__version__ = "0.1.0"

# Shipped profiles are package data, so a plain `pip install .` finds them too.
PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
