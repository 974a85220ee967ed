"""The daemon's loop and operations: the arbiter, the poller, control commands, reload and fallback."""
