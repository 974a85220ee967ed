"""One worker process as the supervisor holds it: its slot and state machine, its launch, its link, its process tree."""
