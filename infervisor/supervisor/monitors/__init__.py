"""Monitors: each looks at the workers and reports findings; core/responses.py acts on them."""
