"""A BERT-style encoder the size of MiniLM-L6: 6 layers, hidden 384, 12 heads, token ids in."""

from __future__ import annotations

import math

import torch
from torch import nn

from infervisor.worker.models.init import default_init_skipped


class EncoderLayer(nn.Module):
    """Post-norm self-attention plus feed-forward, each Linear its own module."""

    def __init__(self, hidden: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = hidden // heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.attn_out = nn.Linear(hidden, hidden)
        self.attn_norm = nn.LayerNorm(hidden, eps=1e-12)
        self.ffn_in = nn.Linear(hidden, ffn)
        self.act = nn.GELU()
        self.ffn_out = nn.Linear(ffn, hidden)
        self.ffn_norm = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, x: torch.Tensor, mask_bias: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, seq, self.heads, self.head_dim).transpose(1, 2)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim) + mask_bias
        context = torch.matmul(torch.softmax(scores, dim=-1), v).transpose(1, 2).reshape(batch, seq, hidden)
        x = self.attn_norm(x + self.attn_out(context))
        return self.ffn_norm(x + self.ffn_out(self.act(self.ffn_in(x))))


class Encoder(nn.Module):
    """Embeddings, six layers, masked mean pooling: returns one 384-d embedding per sequence."""

    def __init__(
        self, vocab: int = 30522, hidden: int = 384, layers: int = 6, heads: int = 12, max_len: int = 512
    ) -> None:
        super().__init__()
        self.word = nn.Embedding(vocab, hidden)
        self.position = nn.Embedding(max_len, hidden)
        self.embed_norm = nn.LayerNorm(hidden, eps=1e-12)
        self.layers = nn.ModuleList([EncoderLayer(hidden, heads, hidden * 4) for _ in range(layers)])
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        x = self.embed_norm(self.word(input_ids) + self.position(positions))
        mask = attention_mask.to(x.dtype)
        mask_bias = ((1.0 - mask) * -1e4)[:, None, None, :]
        for layer in self.layers:
            x = layer(x, mask_bias)
        summed = (x * mask.unsqueeze(-1)).sum(dim=1)
        return summed / mask.sum(dim=1, keepdim=True).clamp(min=1.0)


def encoder() -> Encoder:
    """The MiniLM-L6-sized encoder (22.7 M parameters)."""
    with default_init_skipped(nn.Linear, nn.Embedding):
        return Encoder()
