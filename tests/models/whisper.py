"""A Whisper of random weights (2 + 2 layers of 64, 120 tokens, seeded) saved as a Hugging Face folder with its feature
extractor's settings: the model of parts the tests and ``bench/bench_optimum.py`` quantize."""

from __future__ import annotations

from pathlib import Path

START, END = 1, 2  # the decoder's start token and its end token


def save_whisper(folder: Path) -> Path:
    """The folder, written (``WhisperForConditionalGeneration`` and ``WhisperFeatureExtractor``)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.WhisperConfig(
        vocab_size=120, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=80, max_source_positions=1500,
        max_target_positions=64, pad_token_id=0, bos_token_id=START, eos_token_id=END, decoder_start_token_id=START,
        architectures=["WhisperForConditionalGeneration"],
    )  # fmt: skip
    transformers.WhisperForConditionalGeneration(config).save_pretrained(folder)
    transformers.WhisperFeatureExtractor(feature_size=80).save_pretrained(folder)
    return folder
