"""A target + DFlash drafter pair that TensorRT-LLM's tree-verification kernels can run, made offline.

    python -m tensorrt_llm_dflash.trtllm.demo_pair --output_dir DEMO     # DEMO/target, DEMO/drafter

Why this exists: the embedded SmolLM2-135M-Instruct cannot be served by the engine path.
Its attention has 9 query heads over 3 KV heads (head group 3) of size 64; TensorRT-LLM sends
head groups that do not divide 64 to its precompiled XQA cubins, whose spec-decoding kernels
exist for head size 128 only, so its engine would abort at the first verify step
(``kernel_support.py`` states the rule and its sources). This pair is the engine flow's
correctness demo instead: a small random Qwen3 with the attention shape of Qwen3-8B
(head size 128, head group 2: 4 query heads over 2 KV heads, which the JIT kernels take) and a
random DFlash drafter of the published layout (``dflash_config``, ``model.safetensors``), plus a
character tokenizer. Weights are drawn from a fixed seed and stored in bfloat16 (the engine's
dtype), so the same command writes the same files everywhere and the float64 PyTorch runtime
computes with the engine's weights. The weights are random: the text is noise, the drafter
guesses, and the point is that the engine's tokens equal the PyTorch runtime's. For real text,
convert a published pair (docs/trtllm_engine.md): Qwen3-8B + z-lab/Qwen3-8B-DFlash-b16.
"""

from __future__ import annotations

import argparse
import string
import sys
from pathlib import Path

#: The target's attention: Qwen3-8B's head size, a head group that divides 64 (JIT XQA kernels).
TARGET = {
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 128, "max_position_embeddings": 1024, "rope_theta": 1_000_000.0,
    # TensorRT-LLM's Attention normalises q/k with eps 1e-5 (layers/attention.py); so does this target,
    # so the engine and the PyTorch runtime compute the same function.
    "rms_norm_eps": 1e-5,
}
DRAFTER = {"num_hidden_layers": 2, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 128, "block_size": 8, "target_layer_ids": [0, 2, 3]}
SPECIALS = ["<unk>", "<eos>", "<mask>"]
CHARS = string.ascii_letters + string.digits + string.punctuation + " \n"
VOCAB = len(SPECIALS) + len(CHARS)  # 99: every row is a token the tokenizer can decode


def char_tokenizer():  # noqa: ANN201 - transformers' PreTrainedTokenizerFast
    """One token per character; ``<mask>`` is the drafter's MASK row, ``<eos>`` the stop token."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    table = {tok: i for i, tok in enumerate(SPECIALS + list(CHARS))}
    backend = Tokenizer(models.BPE(vocab=table, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>",
                                   mask_token="<mask>")


def _randomize(model, seed: int, std: float) -> None:
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() > 1:  # N(0, std / sqrt(fan_in)): activations stay O(1) through the layers
                p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64) * std / p.shape[-1] ** 0.5)
            elif "norm" in name:
                p.copy_(torch.rand(p.shape, generator=generator, dtype=torch.float64) + 0.5)


def make_demo_pair(output_dir: str | Path, seed: int = 0) -> tuple[Path, Path]:
    """Write ``output_dir/target`` (HF Qwen3, bf16, with its tokenizer) and ``output_dir/drafter``
    (DFlash, bf16); returns both paths."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from ..config import DFlashDraftConfig
    from ..drafter import DFlashDraftModel, save_dflash_drafter

    out = Path(output_dir)
    tokenizer = char_tokenizer()
    config = Qwen3Config(vocab_size=VOCAB, tie_word_embeddings=False, bos_token_id=None,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
                         attn_implementation="sdpa", torch_dtype="bfloat16", **TARGET)
    target = Qwen3ForCausalLM(config).double()
    _randomize(target, seed, std=2.0)
    with torch.no_grad():  # never generate <unk> or <mask>: the demo's text stays printable
        target.lm_head.weight[[tokenizer.unk_token_id, tokenizer.mask_token_id]] = 0.0
    target.to(torch.bfloat16).save_pretrained(out / "target", safe_serialization=True)
    tokenizer.save_pretrained(out / "target")

    drafter = DFlashDraftModel(DFlashDraftConfig(
        hidden_size=TARGET["hidden_size"], vocab_size=VOCAB, mask_token_id=tokenizer.mask_token_id,
        num_target_layers=TARGET["num_hidden_layers"], rope_theta=TARGET["rope_theta"],
        max_position_embeddings=TARGET["max_position_embeddings"], rms_norm_eps=TARGET["rms_norm_eps"], **DRAFTER))
    drafter = drafter.double()
    _randomize(drafter, seed + 1, std=1.5)
    save_dflash_drafter(drafter, out / "drafter", dtype=torch.bfloat16)
    return out / "target", out / "drafter"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tensorrt_llm_dflash.trtllm.demo_pair", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output_dir", required=True, type=Path, help="writes OUTPUT_DIR/target and OUTPUT_DIR/drafter")
    ap.add_argument("--seed", type=int, default=0, help="weights seed (default 0, the documented pair)")
    args = ap.parse_args(argv)
    if args.output_dir.exists() and any(args.output_dir.iterdir()):
        ap.error(f"argument --output_dir: {str(args.output_dir)!r} is not empty; give a new directory")
    target, drafter = make_demo_pair(args.output_dir, args.seed)
    print(f"target  {target}  (Qwen3, 4 q / 2 KV heads of 128, bf16)\ndrafter {drafter}  (DFlash, block size "
          f"{DRAFTER['block_size']}, bf16)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
