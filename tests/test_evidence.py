"""The gate states its evidence, its advice works in one step, and int8 sees layers under parametrizations."""

from __future__ import annotations

import pytest
import torch

from infervisor.protocol.tensors import TensorSpec
from infervisor.worker.profiles.export import export_quantized
from tests.evidence_models import weight_normed

LINEAR_SPEC = (TensorSpec("x", "float32", (None, 16)),)


@pytest.mark.parametrize("old_style", [False, True])
def test_int8_dynamic_quantizes_linear_layers_under_weight_norm(old_style: bool) -> None:
    """Both weight-normed Linear layers are quantized, the eager module keeps its parametrization, answers agree."""
    module = weight_normed(old_style)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = module(x)
    graph = export_quantized(module, (x,), LINEAR_SPEC, [(x,)], dynamic=True)
    linears = [n for n in graph.graph.nodes if n.op == "call_function" and "linear" in str(n.target)]
    quantized = [n for n in graph.graph.nodes if n.op == "call_function" and "dequantize" in str(n.target)]
    assert len(linears) == 2 and len(quantized) >= 2 * len(linears), (linears, quantized)
    with torch.no_grad():
        again, got = module(x), graph(x)
    assert torch.equal(again, want), "the eager module changed"
    cosine = torch.nn.functional.cosine_similarity(got, want).min()
    assert float(cosine) > 0.99, cosine
