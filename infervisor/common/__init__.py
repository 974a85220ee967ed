"""Torch-free declarations both the supervisor and its workers read: the CPU's capabilities and the profile registry."""
