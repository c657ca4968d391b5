"""``trtllm-build`` with ``--speculative_decoding_mode dflash``.

TensorRT-LLM 1.2.1's ``SpeculativeDecodingMode`` (``tensorrt_llm/models/modeling_utils.py``)
is an ``IntFlag`` kept in sync with ``cpp/tensorrt_llm/runtime/speculativeDecodingMode.h``,
and ``trtllm-build`` (``tensorrt_llm/commands/build.py::parse_arguments``) only accepts
``draft_tokens_external | lookahead_decoding | medusa | explicit_draft_tokens | eagle``.
So ``dflash`` is this project's own CLI name. This entry point:

1. rewrites ``--speculative_decoding_mode dflash`` to ``medusa`` and passes every other
   flag through unchanged;
2. checks the checkpoint (``architecture == "DFlashForCausalLM"``, ``--max_draft_len``
   between ``block_size - 1`` and the DDTree limit) before TensorRT-LLM is imported;
3. refuses a DFlash checkpoint built without ``--speculative_decoding_mode dflash`` (or
   ``medusa``): in 1.2 ``tensorrt_llm/builder.py::build`` no longer forces ``MEDUSA`` for a
   config carrying ``max_draft_len`` (older releases did), so the mode would stay ``NONE``:
   ``max_seq_len`` and ``max_num_tokens`` would not grow by the tree while the
   ``spec_decoding_*`` inputs were still declared;
   It also refuses, by name, a DFlash2 section (``dflash.dflash2``) the engine cannot build
   (``dflash2_support.py``), and an engine TensorRT-LLM's tree-verification attention has no kernel
   for (the target's head group and head size, ``--tokens_per_block``, and the GPU's SM when this
   machine has one; ``kernel_support.py``): such an engine would build and then abort at its
   first verify step ("No available XQA kernels are found for speculative decoding mode");
4. exports ``--max_draft_len`` in ``$TRTLLM_DFLASH_MAX_DRAFT_LEN``, which ``DFlashConfig``
   reads, so ``model.config.max_draft_len`` always equals the flag: ``build`` copies the
   config's value into ``build_config.max_draft_len`` when the flag is absent (1.2), and
   older releases overwrote the flag with it. An environment variable also reaches
   ``mpirun`` ranks and the ``spawn`` workers of ``parallel_build``;
5. loads the plugin library (``trtllm/plugins.py``; spawn workers load it on first use) and registers
   ``MODEL_MAP["DFlashForCausalLM"]`` (``PretrainedConfig.from_dict`` and ``build_model``
   resolve the architecture through it), then calls
   ``tensorrt_llm.commands.build.main()``, which reads ``sys.argv``.

It runs as ``dflash-trtllm-build``, ``python -m tensorrt_llm_dflash.trtllm.build``, or as
TensorRT-LLM's own ``trtllm-build`` through the start-up hook (``trtllm/hook.py``).

Why Medusa: the engine's extra output is ``medusa_logits`` (the drafter's block-1
marginals), the tree is given explicitly per step (``spec_decoding_*`` tensors, as for
Medusa trees; ``speculative_decoding_draft_tokens_external=False``), and
``MEDUSA`` is the mode ``builder.build`` assigned to any config carrying ``max_draft_len``
before 1.2. With MEDUSA, ``build`` adds ``max_draft_len`` to ``max_seq_len`` and raises
``max_num_tokens`` to ``max_batch_size * (max_draft_len + 1)``; ``prepare_inputs`` then
declares the ``spec_decoding_*`` inputs with ``max_draft_len + 1`` tokens per sequence.
EAGLE would bring its own in-graph sampling plugins and a different I/O contract.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ..errors import DFlashConfigError, DFlashError
from .constants import ARCHITECTURE, DFLASH_MODE, MAX_DRAFT_LEN_ENV, MAX_ENGINE_DRAFT_LEN, MODE_FLAG, TRTLLM_MODE
from .dflash2_support import check_section
from .kernel_support import DEFAULT_TOKENS_PER_BLOCK, TargetAttention, device_sm, spec_decoding_kernel


def _flag_value(argv: list[str], flag: str) -> str | None:
    """The last value of ``flag`` in ``argv`` (``--flag v`` or ``--flag=v``), as argparse keeps it."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def translate_argv(argv: list[str]) -> tuple[list[str], bool]:
    """Replace the mode ``dflash`` by ``medusa``; everything else is kept as given."""
    out: list[str] = []
    is_dflash = False
    skip = False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg == MODE_FLAG and i + 1 < len(argv) and argv[i + 1] == DFLASH_MODE:
            out += [MODE_FLAG, TRTLLM_MODE]
            is_dflash, skip = True, True
        elif arg == f"{MODE_FLAG}={DFLASH_MODE}":
            out.append(f"{MODE_FLAG}={TRTLLM_MODE}")
            is_dflash = True
        else:
            out.append(arg)
    return out, is_dflash


def check_checkpoint(argv: list[str], is_dflash: bool) -> tuple[bool, int | None]:
    """Validate a DFlash build before TensorRT-LLM starts.

    Returns (the checkpoint is a DFlash one, ``--max_draft_len`` or None).
    """
    ckpt = _flag_value(argv, "--checkpoint_dir")
    raw_len = _flag_value(argv, "--max_draft_len")
    try:
        max_draft_len = int(raw_len) if raw_len is not None else None
    except ValueError:
        raise DFlashConfigError(f"--max_draft_len={raw_len!r} is not an integer") from None
    config = None
    if ckpt is not None and (Path(ckpt) / "config.json").is_file():
        config = json.loads((Path(ckpt) / "config.json").read_text())
    if config is None or config.get("architecture") != ARCHITECTURE:
        if is_dflash:
            found = None if config is None else config.get("architecture")
            raise DFlashConfigError(
                f"--speculative_decoding_mode dflash needs a checkpoint converted by examples/convert_checkpoint.py "
                f"(architecture {ARCHITECTURE}); --checkpoint_dir={ckpt!r} has architecture {found!r}"
            )
        return False, max_draft_len
    mode = _flag_value(argv, MODE_FLAG)
    if mode != TRTLLM_MODE:
        raise DFlashConfigError(
            f"--checkpoint_dir={ckpt!r} is a DFlash checkpoint: build it with {MODE_FLAG} {DFLASH_MODE} "
            f"(got {MODE_FLAG}={mode!r})"
        )
    block_size = int(config["dflash"]["block_size"])
    effective = max_draft_len if max_draft_len is not None else int(config.get("max_draft_len", block_size - 1))
    if not block_size - 1 <= effective <= MAX_ENGINE_DRAFT_LEN:
        where = "--max_draft_len" if max_draft_len is not None else f"{ckpt}/config.json max_draft_len"
        raise DFlashConfigError(
            f"{where}={effective} is out of range {block_size - 1}..{MAX_ENGINE_DRAFT_LEN}: the DFlash chain needs "
            f"block_size - 1 = {block_size - 1} draft tokens, and TensorRT-LLM builds tree speculative decoding with "
            f"at most {MAX_ENGINE_DRAFT_LEN} (tensorrt_llm/builder.py); pass the largest --ddtree_budget you will run"
        )
    if config["dflash"].get("dflash2") is not None:  # a DFlash2 drafter: what the engine builds of it
        check_section(config["dflash"]["dflash2"], hidden_size=int(config["dflash"]["hidden_size"]),
                      vocab_size=int(config["vocab_size"]), where=f"{ckpt}/config.json dflash.dflash2")
    check_kernels(argv, config, Path(ckpt) / "config.json")
    return True, max_draft_len


def _int_flag(argv: list[str], flag: str, default: int) -> int:
    raw = _flag_value(argv, flag)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise DFlashConfigError(f"{flag}={raw!r} is not an integer") from None


def target_attention(config: dict, where: Path) -> TargetAttention:
    """The target's attention shape from a converted checkpoint's config.json."""
    fields = {}
    for key in ("num_attention_heads", "num_key_value_heads", "head_size"):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DFlashConfigError(f"{where} {key}={value!r}: a positive integer is required (convert the checkpoint "
                                    "with examples/convert_checkpoint.py)")
        fields[key] = value
    tp = int((config.get("mapping") or {}).get("tp_size", 1))
    return TargetAttention(fields["num_attention_heads"], fields["num_key_value_heads"], fields["head_size"],
                           str(config.get("dtype")), tp)


def check_kernels(argv: list[str], config: dict, where: Path) -> str:
    """Refuse, before TensorRT-LLM starts, an engine whose tree verification has no TensorRT-LLM
    attention kernel (kernel_support.py, each rule cited there): the shape, the KV block size and,
    when this machine has a GPU, its SM. Returns the kernel family that will run."""
    kv_cache_type = _flag_value(argv, "--kv_cache_type")
    if kv_cache_type is None:  # the legacy flag; TensorRT-LLM 1.2 builds a paged cache by default
        kv_cache_type = "continuous" if _flag_value(argv, "--paged_kv_cache") == "disable" else "paged"
    if kv_cache_type == "disabled":
        raise DFlashConfigError(
            "--kv_cache_type=disabled: TensorRT-LLM verifies trees with a KV cache only (attentionOp.cpp @ eea41b73, "
            "AttentionOp::initialize); use paged (the default) or continuous")
    tokens_per_block = _int_flag(argv, "--tokens_per_block", DEFAULT_TOKENS_PER_BLOCK)
    return spec_decoding_kernel(target_attention(config, where), paged=kv_cache_type == "paged",
                                tokens_per_block=tokens_per_block, sm=device_sm())


def register_model() -> None:
    """``MODEL_MAP['DFlashForCausalLM'] = DFlashForCausalLM`` (tensorrt_llm/models/__init__.py):
    importing model.py registers it."""
    from . import model  # noqa: F401


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    translated, is_dflash = translate_argv(argv)
    try:
        dflash_checkpoint, max_draft_len = check_checkpoint(translated, is_dflash)
    except DFlashError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if dflash_checkpoint:
        if max_draft_len is not None:
            os.environ[MAX_DRAFT_LEN_ENV] = str(max_draft_len)
        from .plugins import load_plugin_library

        load_plugin_library()  # the engine's DFlashTreeMask / DFlashKVCompact layers
    # Registered for every build: a plain checkpoint builds exactly as with trtllm-build.
    register_model()
    from tensorrt_llm.commands import build as commands_build

    # TensorRT-LLM's own main, also when hook.py has wrapped it (trtllm-build with the .pth).
    trtllm_build_main = getattr(commands_build.main, "__wrapped__", commands_build.main)
    sys.argv = ["trtllm-build", *translated]
    trtllm_build_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
