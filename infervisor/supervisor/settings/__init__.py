"""config.json: reading, validating, diffing and documenting it, and the snapshot the daemon serves with."""
