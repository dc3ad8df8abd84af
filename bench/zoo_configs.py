"""The zoo's architectures from ``transformers`` configs (random weights, small widths): exported by both of torch
2.13's ONNX exporters at their default opsets (dynamo: 18; TorchScript: ``opset_version`` left to torch), batch
(and text length) dynamic, as users export them. Random weights find crashes; they measure no accuracy.

    .venv/bin/python bench/zoo_configs.py OUT_DIR [NAME,...]     # writes NAME.dynamo.onnx, NAME.torchscript.onnx

An export torch itself refuses is reported and skipped (measured with torch 2.13: Swin by dynamo, a Whisper
decoder by TorchScript: ``aten::diff`` at opset 20).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

Built = tuple[Any, tuple[Any, ...], list[str]]  # the module, an example, the input names


def _image() -> tuple[Any, ...]:
    import torch

    return (torch.randn(1, 3, 64, 64),)


def _vision(name: str) -> Built:
    import transformers as t

    small = dict(image_size=64, patch_size=8, hidden_size=96, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=192)  # fmt: skip
    made = {
        "vit": lambda: t.ViTForImageClassification(t.ViTConfig(**small, num_labels=10)),
        "deit": lambda: t.DeiTForImageClassificationWithTeacher(t.DeiTConfig(**small, num_labels=10)),
        "swin": lambda: t.SwinForImageClassification(t.SwinConfig(
            image_size=64, patch_size=4, embed_dim=32, depths=[1, 1], num_heads=[2, 4], window_size=4, num_labels=10)),
        "convnext": lambda: t.ConvNextForImageClassification(t.ConvNextConfig(
            num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10)),
        "regnet": lambda: t.RegNetForImageClassification(t.RegNetConfig(
            embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], groups_width=8, num_labels=10)),
        "clip_vision": lambda: t.CLIPVisionModel(t.CLIPVisionConfig(
            image_size=64, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=128)),
    }  # fmt: skip
    return made[name](), _image(), ["pixel_values"]


def _text(name: str) -> Built:
    import torch
    import transformers as t

    ids = torch.randint(1, 200, (1, 16))
    if name == "bert":
        config = t.BertConfig(vocab_size=200, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              intermediate_size=128)  # fmt: skip
        return t.BertModel(config), (ids, torch.ones_like(ids)), ["input_ids", "attention_mask"]
    config = t.CLIPTextConfig(vocab_size=200, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              intermediate_size=128, max_position_embeddings=32)  # fmt: skip
    return t.CLIPTextModel(config), (ids,), ["input_ids"]


def _whisper(name: str) -> Built:
    import torch
    import transformers as t

    config = t.WhisperConfig(
        vocab_size=300, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=80,
        max_source_positions=50, max_target_positions=32, pad_token_id=0, decoder_start_token_id=1,
    )  # fmt: skip
    whisper = t.WhisperModel(config)
    if name == "whisper_encoder":
        return whisper.get_encoder(), (torch.randn(1, 80, 100),), ["input_features"]

    class Decoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.decoder = whisper.get_decoder()

        def forward(self, input_ids: Any, encoder_hidden_states: Any) -> Any:
            return self.decoder(input_ids=input_ids, encoder_hidden_states=encoder_hidden_states,
                                use_cache=False).last_hidden_state  # fmt: skip

    return Decoder(), (torch.randint(0, 300, (1, 8)), torch.randn(1, 50, 64)), ["input_ids", "encoder_hidden_states"]


ARCHITECTURES: dict[str, Callable[[str], Built]] = {
    **{n: _vision for n in ("vit", "deit", "swin", "convnext", "regnet", "clip_vision")},
    "bert": _text,
    "clip_text": _text,
    "whisper_encoder": _whisper,
    "whisper_decoder": _whisper,
}
EXPORTERS = ("dynamo", "torchscript")


def _first_output(module: Any, inputs: int) -> Any:
    """``module`` returning its first output as one tensor, with a fixed signature (torch.export reads it)."""
    import torch

    class One(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = module.eval()

        def forward(self, a: Any) -> Any:
            out = self.inner(a)
            return out if isinstance(out, torch.Tensor) else out[0]

    class Two(One):
        def forward(self, a: Any, b: Any) -> Any:  # type: ignore[override]
            out = self.inner(a, b)
            return out if isinstance(out, torch.Tensor) else out[0]

    return One() if inputs == 1 else Two()


def export(name: str, exporter: str, path: Path) -> str:
    """Export architecture ``name`` with ``exporter`` to ``path``; "" when done, else why torch refused."""
    import torch

    torch.manual_seed(0)
    module, example, names = ARCHITECTURES[name](name)
    axes = {n: ({0: "batch", 1: "text"} if n in ("input_ids", "attention_mask") else {0: "batch"}) for n in names}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(_first_output(module, len(names)), example, str(path), input_names=names,
                              output_names=["out"], dynamic_axes=axes, dynamo=exporter == "dynamo")  # fmt: skip
    except Exception as error:  # torch's refusal is a finding of the zoo, not its end
        path.unlink(missing_ok=True)
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        said = next((line for line in reversed(lines) if "Error" in line and "Refer to" not in line), lines[-1] if lines else "")
        return f"{type(error).__name__}: {said[:200]}"
    return ""


def samples(path: Path, count: int, seed: int) -> list[dict[str, np.ndarray]]:
    """Random inputs shaped as the export's (ids below the vocabularies above, masks of ones)."""
    import onnx

    rng = np.random.default_rng(seed)
    model = onnx.load(str(path), load_external_data=False)
    constants = {t.name for t in model.graph.initializer}
    out = []
    for _ in range(count):
        sample = {}
        for value in [v for v in model.graph.input if v.name not in constants]:
            dims = [d.dim_value if d.dim_value > 0 else 1 for d in value.type.tensor_type.shape.dim]
            if value.name in ("input_ids", "attention_mask"):
                dims[1] = int(rng.integers(8, 17))
            if value.name == "input_ids":
                sample[value.name] = rng.integers(1, 200, dims).astype(np.int64)
            elif value.name == "attention_mask":
                sample[value.name] = np.ones(dims, np.int64)
            else:
                sample[value.name] = rng.standard_normal(dims).astype(np.float32)
        if "attention_mask" in sample:  # the same length as its ids
            sample["attention_mask"] = np.ones_like(sample["input_ids"])
        out.append(sample)
    return out


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name in sys.argv[2].split(",") if len(sys.argv) > 2 else ARCHITECTURES:
        for exporter in EXPORTERS:
            path = out / f"{name}.{exporter}.onnx"
            refused = "" if path.exists() else export(name, exporter, path)
            print(f"{path.name}: {'torch refused: ' + refused if refused else 'exported'}", flush=True)


if __name__ == "__main__":
    main()
