"""The box the daemon runs on: cores, pinning, directories, locks, systemd, sockets' group, file watching, logs."""
