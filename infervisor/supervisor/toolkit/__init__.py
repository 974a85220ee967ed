"""The Model-Optimizer toolkit: constraints, doctor, optimize (seed 2 made into commands); imports no torch."""
