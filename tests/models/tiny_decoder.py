"""A tiny causal language model for the tests: a 2-layer Llama (hidden 128) trained for a few seconds on
requant's own docs with a byte-level BPE tokenizer trained on them, saved as a Hugging Face folder
(``config.json``, ``model.safetensors``, ``tokenizer.json``), and exported to an onnxruntime-genai folder
by the genai model builder (float32), as ``requant quantize`` does for such a folder.

Trained, not random: its perplexity on held-out text (~30) is far below the vocabulary's 512, so what
quantization does to it shows.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 512
HIDDEN = 128
STEPS = 150
CONTEXT = 128


def docs_text() -> tuple[str, str]:
    """(training/calibration text, held-out text): requant's docs, the last two pages held out."""
    pages = sorted((ROOT / "docs").glob("*.md"))
    texts = [p.read_text(encoding="utf-8") for p in pages]
    return "\n\n".join(texts[:-2]), "\n\n".join(texts[-2:])


def _tokenizer(text: str) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator([text], trainer)
    return tok


def make_hf_folder(folder: Path) -> Path:
    """The trained tiny Llama and its tokenizer, saved in ``folder``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    text, _ = docs_text()
    tok = _tokenizer(text)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)  # fmt: skip
    model = LlamaForCausalLM(config)
    ids = torch.tensor(tok.encode(text).ids)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        starts = torch.randint(0, ids.numel() - CONTEXT - 1, (8,), generator=generator)
        batch = torch.stack([ids[s : s + CONTEXT] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


def untied_copy(hf_folder: Path, out: Path) -> Path:
    """The Hugging Face model of ``hf_folder`` with its LM head untied from its embedding (a copy of the same
    weights: ``tie_word_embeddings=False``), and its tokenizer, saved in ``out``."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_folder)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    model.save_pretrained(out)
    for item in hf_folder.iterdir():
        if item.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(item, out / item.name)
    return out


def make_random_decoder(root: Path, layers: int, hidden: int, mlp: int, heads: int = 16) -> Path:
    """A Llama of random weights (``torch.manual_seed(0)``; the tokenizer of the tiny decoder, a tied embedding)
    exported to an onnxruntime-genai folder in ``root / "genai"``: for memory and time, not perplexity."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    text, _ = docs_text()
    fast = PreTrainedTokenizerFast(tokenizer_object=_tokenizer(text), bos_token="<|endoftext|>",
                                   eos_token="<|endoftext|>")  # fmt: skip
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)  # fmt: skip
    hf = root / "hf"
    LlamaForCausalLM(config).save_pretrained(hf)
    fast.save_pretrained(hf)
    return make_genai_folder(hf, root / "genai")


def make_genai_folder(hf_folder: Path, out: Path) -> Path:
    """onnxruntime-genai's builder's float32 CPU export of ``hf_folder`` in ``out``."""
    command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_folder), "-o", str(out),
               "-p", "fp32", "-e", "cpu", "-c", str(out.parent / "cache")]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True)
    return out
