"""The Open Inference Protocol (KServe v2) gateway: a child process of the daemon, a ZeroMQ client of its broker."""
