"""What the daemon measures about itself, as leaves the core, the CLI and the bench scripts read."""
