"""What the parts of the daemon write as they work: anomaly counts and request times (leaves)."""
