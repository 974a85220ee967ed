"""infervisor: the daemon (`infervisor.supervisor`), its workers, the wire and the shared declarations."""
