"""The channel between devices and edge: channel state (`state`), Shannon rates (`rates`), the emulator
process that holds the real ZeroMQ messages for their air time (`proxy`), its validation (`validate`),
and an optional kernel shaper for LAN interfaces (`tc_backend`, see TC_BACKEND.md)."""

# How long before a release deadline the emulator stops sleeping and busy-waits: sleep() overshoots by
# by a fraction of a millisecond on a shared CPU; the busy window absorbs that.
DEFAULT_SPIN_S = 0.0005
