"""Monitors: each looks at the workers and reports findings; the arbiter acts on them."""
