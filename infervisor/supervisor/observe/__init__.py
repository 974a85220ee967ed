"""What the daemon says about itself: recorders the broker writes to (a leaf), one snapshot taken from the broker,
the pool and the monitors (`capture`), and the status document and Prometheus exposition that render it."""
