"""A target + DFlash drafter pair that TensorRT-LLM's tree-verification kernels can run, made offline.

    python -m tensorrt_llm_dflash.trtllm.demo_pair --output_dir DEMO     # DEMO/target, DEMO/drafter
    python -m tensorrt_llm_dflash.trtllm.demo_pair --dflash2 --output_dir DEMO2   # a DFlash2 drafter

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

``--dflash2`` writes the same target with a random DFlash2 drafter instead (docs/dflash2.md),
in z-lab's published nested layout (Muse-Glimmer-30B-DFlash2: everything in ``dflash_config``,
``rope_parameters``, bidirectional sliding-window layers), with that checkpoint's settings scaled
down: convolutions of 2 taps over groups of 16 channels, a selector of rank 32 over the top 16
candidates, a soft cap of 20 and an output multiplier (0.75, exact in float32 as the engine
holds it). Its sliding window (24 tokens) binds within a demo run, so the engine's window mask
is exercised too.
"""

from __future__ import annotations

import argparse
import string
import sys
from pathlib import Path

from ..files import _usual_mode

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
#: The ``--dflash2`` drafter: DRAFTER's layers and block, plus the DFlash2 settings (dflash_config).
DFLASH2 = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 32, "selector_top_k": 16,
           "output_multiplier": 0.75, "final_logit_softcapping": 20.0}
DFLASH2_WINDOW = 24
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


def dflash2_config(mask_token_id: int) -> dict:
    """The ``--dflash2`` drafter's config.json, in z-lab's nested layout."""
    return {
        "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "is_causal": False,
        "hidden_size": TARGET["hidden_size"], "intermediate_size": DRAFTER["intermediate_size"],
        "num_hidden_layers": DRAFTER["num_hidden_layers"], "num_attention_heads": DRAFTER["num_attention_heads"],
        "num_key_value_heads": DRAFTER["num_key_value_heads"], "head_dim": DRAFTER["head_dim"], "vocab_size": VOCAB,
        "num_target_layers": TARGET["num_hidden_layers"], "rms_norm_eps": TARGET["rms_norm_eps"],
        "max_position_embeddings": TARGET["max_position_embeddings"], "hidden_act": "silu", "attention_bias": False,
        "rope_parameters": {"rope_theta": TARGET["rope_theta"], "rope_type": "default"},
        "layer_types": ["sliding_attention"] * DRAFTER["num_hidden_layers"], "sliding_window": DFLASH2_WINDOW,
        "use_sliding_window": True, "tie_word_embeddings": False, "dtype": "bfloat16",
        "dflash_config": {"block_size": DRAFTER["block_size"], "mask_token_id": mask_token_id,
                          "target_layer_ids": DRAFTER["target_layer_ids"], **DFLASH2},
    }


def _make_dflash2_drafter(path: Path, mask_token_id: int, seed: int) -> None:
    import torch

    from ..dflash2 import DFlash2Config, DFlash2DraftModel, save_dflash2_drafter

    drafter = DFlash2DraftModel(DFlash2Config.from_dict(dflash2_config(mask_token_id))).double()
    _randomize(drafter, seed, std=1.5)
    generator = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in sorted(drafter.named_parameters()):
            if name.endswith("base_kernel"):  # near the identity: the block still carries its embeddings
                p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64) * 0.2)
                p[:, 0] += 1.0
            elif "codebook" in name:  # a pairwise term of the unary scores' size, so it changes choices
                p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64) * 0.5)
    save_dflash2_drafter(drafter, path, dtype=torch.bfloat16)


def _usual_modes(directory: Path) -> None:
    """Give every file under ``directory`` the mode ``open`` gives (files.py's rule): transformers'
    ``save_pretrained`` writes model.safetensors through safetensors, which creates its files 0600,
    so the target's weights were unreadable to the group and others while every other file was not."""
    for path in sorted(directory.rglob("*")):
        if path.is_file() and not path.is_symlink():
            _usual_mode(path)


def make_demo_pair(output_dir: str | Path, seed: int = 0, dflash2: bool = False) -> tuple[Path, Path]:
    """Write ``output_dir/target`` (HF Qwen3, bf16, with its tokenizer) and ``output_dir/drafter``
    (DFlash, or DFlash2 with ``dflash2``, bf16); returns both paths."""
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

    _usual_modes(out / "target")
    if dflash2:
        _make_dflash2_drafter(out / "drafter", tokenizer.mask_token_id, seed + 1)
        _usual_modes(out / "drafter")
        return out / "target", out / "drafter"
    drafter = DFlashDraftModel(DFlashDraftConfig(
        hidden_size=TARGET["hidden_size"], vocab_size=VOCAB, mask_token_id=tokenizer.mask_token_id,
        num_target_layers=TARGET["num_hidden_layers"], rope_theta=TARGET["rope_theta"],
        max_position_embeddings=TARGET["max_position_embeddings"], rms_norm_eps=TARGET["rms_norm_eps"], **DRAFTER))
    drafter = drafter.double()
    _randomize(drafter, seed + 1, std=1.5)
    save_dflash_drafter(drafter, out / "drafter", dtype=torch.bfloat16)
    _usual_modes(out / "drafter")
    return out / "target", out / "drafter"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tensorrt_llm_dflash.trtllm.demo_pair", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output_dir", required=True, type=Path, help="writes OUTPUT_DIR/target and OUTPUT_DIR/drafter")
    ap.add_argument("--seed", type=int, default=0, help="weights seed (default 0, the documented pair)")
    ap.add_argument("--dflash2", action="store_true",
                    help="a random DFlash2 drafter (z-lab's layout: convolutions and a candidate selector) instead")
    args = ap.parse_args(argv)
    if args.output_dir.exists() and any(args.output_dir.iterdir()):
        ap.error(f"argument --output_dir: {str(args.output_dir)!r} is not empty; give a new directory")
    target, drafter = make_demo_pair(args.output_dir, args.seed, dflash2=args.dflash2)
    kind = (f"DFlash2, selector top {DFLASH2['selector_top_k']} of rank {DFLASH2['selector_rank']}" if args.dflash2
            else "DFlash")
    print(f"target  {target}  (Qwen3, 4 q / 2 KV heads of 128, bf16)\ndrafter {drafter}  ({kind}, block size "
          f"{DRAFTER['block_size']}, bf16)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
