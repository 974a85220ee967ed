"""Worker processes: launching, links, the slot state machine, the pool and its rolling replacements."""
