"""Put first on PYTHONPATH by a test, this shadows the real package: `import openvino` fails as on a box without it."""

raise ImportError("No module named 'openvino' (shadowed by tests/no_openvino for a test)")
