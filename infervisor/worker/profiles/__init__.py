"""Optimisation profiles: named transformations of a loaded model, each validated against eager before it serves."""
