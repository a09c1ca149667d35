"""The channel between devices and edge: channel state (`state`), Shannon rates (`rates`), the emulator
process that holds the real ZeroMQ messages for their air time (`proxy`), its validation (`validate`),
and an optional kernel shaper for LAN interfaces (`tc_backend`, see TC_BACKEND.md)."""
