"""Multi-SPIN testbed core: model, optimizer, sampling, protocol, controller, records."""

__version__ = "0.1.0"
