"""The request path: client sockets, admission, queues, batching, routing to workers and the one reply."""
