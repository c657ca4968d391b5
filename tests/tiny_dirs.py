"""Tiny targets on disk, as a user would pass them to the CLIs: config.json + safetensors and a
character-level tokenizer with a chat template (offline, built here)."""

from __future__ import annotations

import string
from pathlib import Path

import torch
from tiny_models import tiny_target

SPECIALS = ["<unk>", "<eos>", "<mask>"]
CHARS = string.ascii_lowercase + string.digits + " \n().,:_='\"[]>"


def char_tokenizer(vocab: int = 64):
    """One token per character (unknown characters -> <unk>); len < vocab, so a MASK row is free."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = CHARS[: vocab - len(SPECIALS) - 2]
    table = {tok: i for i, tok in enumerate(SPECIALS + list(chars))}
    backend = Tokenizer(models.BPE(vocab=table, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")
    tok.chat_template = "{% for m in messages %}{{ m['content'] | lower }}\n{% endfor %}"
    return tok


def save_tiny_target_dir(path: str | Path, arch: str = "qwen3", seed: int = 0, layers: int = 6,
                         dtype: torch.dtype = torch.float32, max_positions: int = 512) -> Path:
    """A random tiny target saved like a Hugging Face checkpoint; returns ``path``."""
    path = Path(path)
    model = tiny_target(arch, seed=seed, vocab=64, layers=layers, dtype=dtype, max_positions=max_positions)
    model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


def save_long_context_pair(root: str | Path) -> tuple[Path, Path]:
    """(target dir, drafter dir): a 2-layer tiny Qwen3 with 2048 positions (a HumanEval prompt is a few hundred
    characters, one token each here) and a block-4 DFlash drafter made for it, for the tools that read prompt sets."""
    from tiny_models import tiny_drafter

    from tensorrt_llm_dflash.drafter import save_dflash_drafter
    from tensorrt_llm_dflash.target import load_target

    root = Path(root)
    target_dir = save_tiny_target_dir(root / "target", arch="qwen3", seed=2, layers=2, max_positions=2048)
    model, _ = load_target(target_dir, dtype=torch.float32)
    save_dflash_drafter(tiny_drafter(model, block_size=4, seed=2), root / "drafter", dtype=torch.float32)
    return target_dir, root / "drafter"
