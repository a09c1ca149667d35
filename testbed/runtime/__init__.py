"""What every node process shares: errors, CURVE security, waiting, timeline stamps, link
estimation, plug-in loading, energy accounting and the run directory's record files."""
