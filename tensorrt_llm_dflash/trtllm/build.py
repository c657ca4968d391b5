"""``trtllm-build`` with ``--speculative_decoding_mode dflash``.

TensorRT-LLM 1.2.1's ``SpeculativeDecodingMode`` (``tensorrt_llm/models/modeling_utils.py``)
is an ``IntFlag`` kept in sync with ``cpp/tensorrt_llm/runtime/speculativeDecodingMode.h``,
and ``trtllm-build`` (``tensorrt_llm/commands/build.py::parse_arguments``) only accepts
``draft_tokens_external | lookahead_decoding | medusa | explicit_draft_tokens | eagle``.
So ``dflash`` is this project's own CLI name. This entry point:

1. rewrites ``--speculative_decoding_mode dflash`` to ``medusa`` and passes every other
   flag through unchanged; flags are read as trtllm-build's argparse reads them (``--flag=v``
   and unique prefixes such as ``--max_draft 300``), so no spelling skips the checks below;
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
   ``mpirun`` ranks and the ``spawn`` workers of ``parallel_build``. Without the flag it is
   removed, so a value left in the environment never replaces the checkpoint's unchecked;
5. loads the plugin library (``trtllm/plugins.py``; spawn workers load it on first use) and registers
   ``MODEL_MAP["DFlashForCausalLM"]`` (``PretrainedConfig.from_dict`` and ``build_model``
   resolve the architecture through it), then calls
   ``tensorrt_llm.commands.build.main()``, which reads ``sys.argv``, with ``--output_dir`` a
   staging sibling published whole only when it holds config.json and every rank's engine
   (a ``--dry_run`` publishes nothing).

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

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import NamedTuple

from ..errors import DFlashConfigError, DFlashError
from ..files import holds_current_directory, publish_dir
from .constants import ARCHITECTURE, DFLASH_MODE, MAX_DRAFT_LEN_ENV, MAX_ENGINE_DRAFT_LEN, MODE_FLAG, TRTLLM_MODE
from .dflash2_support import check_section
from .kernel_support import DEFAULT_TOKENS_PER_BLOCK, TargetAttention, device_sm, spec_decoding_kernel

#: The module ``trtllm-build`` runs (TensorRT-LLM's setup.py: ``tensorrt_llm.commands.build:main``).
TRTLLM_BUILD_MODULE = "tensorrt_llm.commands.build"
#: trtllm-build's --output_dir default (tensorrt_llm/commands/build.py).
DEFAULT_OUTPUT_DIR = "engine_outputs"
#: What a build writes into --output_dir: a rebuild's leftovers of these (a rank the new build lacks) go.
ENGINE_FILES = ("config.json", "rank*.engine")

#: Every option string of TensorRT-LLM 1.2.1's ``trtllm-build``: ``parse_arguments`` in
#: tensorrt_llm/commands/build.py @ 65f1d153 plus ``cli_plugin_args`` (``add_plugin_argument``) in
#: tensorrt_llm/plugin/plugin.py @ c20322ff. argparse takes any unique prefix of any of them
#: (``--max_draft 300`` is ``--max_draft_len 300``), so the flags read here must be resolved
#: against all of them, or an abbreviation would skip every check below. Used when TensorRT-LLM's
#: own parser is not loaded yet (:func:`known_flags`).
TRTLLM_BUILD_FLAGS: frozenset[str] = frozenset({
    "-h", "--help",
    "--checkpoint_dir", "--model_config", "--build_config", "--model_cls_file", "--model_cls_name", "--output_dir",
    "--max_batch_size", "--max_input_len", "--max_seq_len", "--max_decoder_seq_len", "--max_beam_width",
    "--max_num_tokens", "--opt_num_tokens", "--max_encoder_input_len", "--max_prompt_embedding_table_size",
    "--max_multimodal_len", "--kv_cache_type", "--paged_kv_cache", "--input_timing_cache", "--output_timing_cache",
    "--profiling_verbosity", "--strip_plan", "--weight_sparsity", "--weight_streaming", "--fast_build", "--workers",
    "--log_level", "--enable_debug_output", "--visualize_network", "--dry_run", "--monitor_memory",
    "--logits_dtype", "--gather_context_logits", "--gather_generation_logits", "--gather_all_token_logits",
    "--lora_dir", "--lora_ckpt_source", "--lora_target_modules", "--max_lora_rank",
    "--speculative_decoding_mode", "--max_draft_len",
    # add_plugin_argument: the PluginConfig fields in cli_plugin_args
    "--bert_attention_plugin", "--gpt_attention_plugin", "--gemm_plugin", "--gemm_swiglu_plugin",
    "--fp8_rowwise_gemm_plugin", "--lora_plugin", "--dora_plugin", "--moe_plugin", "--mamba_conv1d_plugin",
    "--nccl_plugin", "--low_latency_gemm_plugin", "--low_latency_gemm_swiglu_plugin", "--gemm_allreduce_plugin",
    "--context_fmha", "--bert_context_fmha_fp32_acc", "--remove_input_padding", "--tokens_per_block",
    "--use_paged_context_fmha", "--use_fp8_context_fmha", "--fuse_fp4_quant", "--multiple_profiles", "--paged_state",
    "--streamingllm", "--norm_quant_fusion", "--reduce_fusion", "--user_buffer", "--use_fused_mlp",
    "--pp_reduce_scatter",
})

#: argparse reads a token like this as a value, not an option (``_negative_number_matcher``;
#: trtllm-build defines no option that looks like a negative number).
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


def known_flags() -> tuple[frozenset[str], bool]:
    """``trtllm-build``'s option strings and whether its parser takes abbreviations.

    From TensorRT-LLM's own parser when its module is already imported (``trtllm-build`` through
    hook.py imported it to reach ``main``; in 1.2.1 ``parse_arguments`` only builds and returns
    the parser), else :data:`TRTLLM_BUILD_FLAGS`: ``dflash-trtllm-build`` checks before
    TensorRT-LLM is imported, which takes seconds and a GPU context.
    """
    parse_arguments = getattr(sys.modules.get(TRTLLM_BUILD_MODULE), "parse_arguments", None)
    if callable(parse_arguments):
        parser = parse_arguments()
        if isinstance(parser, argparse.ArgumentParser):
            return frozenset(s for action in parser._actions for s in action.option_strings), parser.allow_abbrev
    return TRTLLM_BUILD_FLAGS, True


def _resolve(arg: str, flags: frozenset[str], allow_abbrev: bool) -> tuple[str, str | None] | None:
    """(the flag ``arg`` names, its ``=`` value or None) as argparse's ``_parse_optional`` reads
    it: an exact flag, ``--flag=value``, or a unique prefix of one (with or without ``=value``);
    None for a value or an option trtllm-build does not define (its own argparse refuses that)."""
    if arg in flags:
        return arg, None
    name, eq, value = arg.partition("=")
    if eq and name in flags:
        return name, value
    if allow_abbrev and arg.startswith("--"):
        matches = sorted(flag for flag in flags if flag.startswith(name))
        if len(matches) > 1:  # argparse's own error, raised here before anything reads a guessed flag
            raise DFlashConfigError(f"ambiguous option: {arg} could match {', '.join(matches)}")
        if matches:
            return matches[0], value if eq else None
    return None


class _Option(NamedTuple):
    index: int  # of the flag in argv
    flag: str  # as trtllm-build defines it
    value: str | None  # None: no value follows (argparse refuses it)
    inline: bool  # ``--flag=value``, else the value is argv[index + 1]


def _options(argv: list[str]) -> list[_Option]:
    """The options in ``argv`` as trtllm-build's argparse reads them, flags resolved."""
    flags, allow_abbrev = known_flags()

    def is_option(arg: str) -> bool:  # argparse never takes such a token as a value
        if _resolve(arg, flags, allow_abbrev) is not None:
            return True
        return arg.startswith("-") and len(arg) > 1 and not _NEGATIVE_NUMBER.match(arg) and " " not in arg

    found = []
    for i, arg in enumerate(argv):
        if arg == "--":  # everything after it is positional (and refused: trtllm-build takes none)
            break
        resolved = _resolve(arg, flags, allow_abbrev)
        if resolved is None:
            continue
        flag, value = resolved
        if value is not None:
            found.append(_Option(i, flag, value, True))
        elif i + 1 < len(argv) and argv[i + 1] != "--" and not is_option(argv[i + 1]):
            found.append(_Option(i, flag, argv[i + 1], False))
        else:
            found.append(_Option(i, flag, None, False))
    return found


def _flag_value(argv: list[str], flag: str) -> str | None:
    """The last value of ``flag`` in ``argv``, as argparse keeps it (``--flag v``, ``--flag=v``,
    or a unique prefix of ``flag`` in either form)."""
    value = None
    for option in _options(argv):
        if option.flag == flag and option.value is not None:
            value = option.value
    return value


def _with_flag_value(argv: list[str], flag: str, value: str) -> list[str]:
    """``argv`` with every value of ``flag`` (however given or abbreviated) replaced by ``value``, or the flag
    appended where it is absent."""
    out = list(argv)
    options = [option for option in _options(argv) if option.flag == flag and option.value is not None]
    for option in options:
        if option.inline:
            out[option.index] = f"{flag}={value}"
        else:
            out[option.index + 1] = value
    return out if options else [*out, flag, value]


def check_output_dir(argv: list[str]) -> Path:
    """The engine directory a DFlash build publishes (trtllm-build's ``--output_dir``, default
    ``engine_outputs``, tensorrt_llm/commands/build.py). TensorRT-LLM writes config.json and then each
    ``rank{N}.engine`` in place, so a killed rebuild left a directory that mixed two builds and looked
    complete; the build now runs in a staging sibling published whole (files.publish_dir). The checkpoint's
    own directory is refused: its config.json would be replaced by the engine's."""
    output = Path(_flag_value(argv, "--output_dir") or DEFAULT_OUTPUT_DIR)
    ckpt = _flag_value(argv, "--checkpoint_dir")
    if ckpt is not None and output.resolve() == Path(ckpt).resolve():
        raise DFlashConfigError(f"--output_dir={str(output)!r} is also --checkpoint_dir: the engine's config.json "
                                "would replace the checkpoint's; give the engine a directory of its own")
    if output.exists() and not output.is_dir():
        raise DFlashConfigError(f"--output_dir={str(output)!r} exists and is not a directory")
    if holds_current_directory(output) is not None:
        raise DFlashConfigError(f"--output_dir={str(output)!r} is (or holds) the current directory: the engine "
                                "directory is published whole, replacing it; give the engine a directory of its own")
    return output


def translate_argv(argv: list[str]) -> tuple[list[str], bool]:
    """Replace the mode ``dflash`` by ``medusa`` (under the flag's full name, however it was
    abbreviated); everything else is kept as given."""
    out = list(argv)
    is_dflash = False
    for option in _options(argv):
        if option.flag != MODE_FLAG or option.value != DFLASH_MODE:
            continue
        is_dflash = True
        if option.inline:
            out[option.index] = f"{MODE_FLAG}={TRTLLM_MODE}"
        else:
            out[option.index:option.index + 2] = [MODE_FLAG, TRTLLM_MODE]
    return out, is_dflash


def _positive_int(section: dict, key: str, where: str) -> int:
    value = section.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DFlashConfigError(f"{where}{key}={value!r}: a positive integer is required (convert the checkpoint "
                                "with examples/convert_checkpoint.py)")
    return value


def read_config(ckpt: str | None, is_dflash: bool) -> dict | None:
    """``--checkpoint_dir``'s config.json, or None where a plain build needs none from here.

    A missing directory, an unreadable or malformed config.json can never build (TensorRT-LLM
    reads both), so they are refused by name instead of failing later with a traceback.
    """
    if ckpt is None:
        if is_dflash:
            raise DFlashConfigError(f"{MODE_FLAG} {DFLASH_MODE} needs --checkpoint_dir (a checkpoint converted by "
                                    "examples/convert_checkpoint.py); none was given")
        return None
    directory = Path(ckpt)
    if not directory.exists():
        raise DFlashConfigError(f"--checkpoint_dir={ckpt!r} does not exist")
    if not directory.is_dir():
        raise DFlashConfigError(f"--checkpoint_dir={ckpt!r} is not a directory")
    path = directory / "config.json"
    if not path.exists():
        if is_dflash:
            raise DFlashConfigError(f"--checkpoint_dir={ckpt!r} has no config.json: {MODE_FLAG} {DFLASH_MODE} needs "
                                    f"a checkpoint converted by examples/convert_checkpoint.py")
        return None  # a plain build may take its config from --model_config
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise DFlashConfigError(f"--checkpoint_dir={ckpt!r}: {path} is not valid JSON ({err})") from None
    except (OSError, UnicodeDecodeError) as err:
        raise DFlashConfigError(f"--checkpoint_dir={ckpt!r}: {path} cannot be read ({err})") from None
    if not isinstance(config, dict):
        raise DFlashConfigError(f"--checkpoint_dir={ckpt!r}: {path} holds a JSON {type(config).__name__}, "
                                "a JSON object is required")
    return config


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
    config = read_config(ckpt, is_dflash)
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
    where = f"{ckpt}/config.json"
    section = config.get("dflash")
    if not isinstance(section, dict):
        raise DFlashConfigError(f"{where} dflash={section!r}: a DFlash checkpoint needs its dflash section (the "
                                "drafter's block_size, hidden_size, ...); convert it with examples/convert_checkpoint.py")
    block_size = _positive_int(section, "block_size", f"{where} dflash.")
    if max_draft_len is not None:
        effective = max_draft_len
    else:
        effective = config.get("max_draft_len", block_size - 1)
        if isinstance(effective, bool) or not isinstance(effective, int):
            raise DFlashConfigError(f"{where} max_draft_len={effective!r}: an integer is required (or pass "
                                    "--max_draft_len)")
    if not block_size - 1 <= effective <= MAX_ENGINE_DRAFT_LEN:
        name = "--max_draft_len" if max_draft_len is not None else f"{where} max_draft_len"
        raise DFlashConfigError(
            f"{name}={effective} is out of range {block_size - 1}..{MAX_ENGINE_DRAFT_LEN}: the DFlash chain needs "
            f"block_size - 1 = {block_size - 1} draft tokens, and TensorRT-LLM builds tree speculative decoding with "
            f"at most {MAX_ENGINE_DRAFT_LEN} (tensorrt_llm/builder.py); pass the largest --ddtree_budget you will run"
        )
    if section.get("dflash2") is not None:  # a DFlash2 drafter: what the engine builds of it
        check_section(section["dflash2"], hidden_size=_positive_int(section, "hidden_size", f"{where} dflash."),
                      vocab_size=_positive_int(config, "vocab_size", f"{where} "), where=f"{where} dflash.dflash2")
    gathered = [o.flag for o in _options(argv) if o.flag in ("--gather_context_logits", "--gather_all_token_logits")]
    if gathered:
        # TensorRT-LLM's main raises it with --max_draft_len > 0, after its import (a traceback, not a refusal), and
        # without the flag it never sees the checkpoint's draft length: refused whichever way the length is given.
        raise DFlashConfigError(f"{gathered[0]}: TensorRT-LLM builds no engine with a draft length and context "
                                "logits (tensorrt_llm/commands/build.py, main: 'Gather context logits is not "
                                "support with draft len > 0'); leave it out")
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
    try:
        translated, is_dflash = translate_argv(argv)
        dflash_checkpoint, max_draft_len = check_checkpoint(translated, is_dflash)
        output_dir = check_output_dir(translated) if dflash_checkpoint else None
    except DFlashError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if dflash_checkpoint:
        if max_draft_len is not None:
            os.environ[MAX_DRAFT_LEN_ENV] = str(max_draft_len)
        else:  # a value left in the environment (or by an earlier build here) would override the checkpoint's
            os.environ.pop(MAX_DRAFT_LEN_ENV, None)
        from .plugins import load_plugin_library

        try:
            load_plugin_library()  # the engine's DFlashTreeMask / DFlashKVCompact layers
        except (OSError, RuntimeError) as err:  # missing, damaged or foreign: one line, before anything is built
            print(f"error: {err}", file=sys.stderr)
            return 2
    # Registered for every build: a plain checkpoint builds exactly as with trtllm-build.
    register_model()
    from tensorrt_llm.commands import build as commands_build

    # TensorRT-LLM's own main, also when hook.py has wrapped it (trtllm-build with the .pth).
    trtllm_build_main = getattr(commands_build.main, "__wrapped__", commands_build.main)
    if output_dir is None:  # a plain build: exactly as trtllm-build
        sys.argv = ["trtllm-build", *translated]
        trtllm_build_main()
        return 0
    from tensorrt_llm._utils import mpi_world_size

    if mpi_world_size() > 1:
        # Under mpirun every rank builds its own engines into one directory (parallel_build): a staging directory
        # per process would hold one rank's engines each, so the build is not staged there, as TensorRT-LLM builds.
        print(f"note: built under mpirun ({mpi_world_size()} processes): the engine is written to {output_dir} "
              "directly, not staged; a failed build leaves it incomplete (--workers N builds staged)",
              file=sys.stderr)
        sys.argv = ["trtllm-build", *translated]
        trtllm_build_main()
        return 0
    # A dry run writes config.json alone (Engine.save without an engine): published, it replaced the engine.
    dry_run = any(option.flag == "--dry_run" for option in _options(translated))
    try:
        with publish_dir(output_dir, ENGINE_FILES) as staging:
            sys.argv = ["trtllm-build", *_with_flag_value(translated, "--output_dir", str(staging))]
            trtllm_build_main()
            if dry_run:
                raise _Unpublished(f"--dry_run: nothing is published; {output_dir} is unchanged", 0)
            missing = missing_engine_files(staging, translated)
            if missing:
                raise _Unpublished(f"the build wrote no complete engine: it has no {', '.join(missing)} (the "
                                   f"checkpoint's world_size is {_world_size(translated)}); {output_dir} is unchanged",
                                   2)
    except _Unpublished as unpublished:
        print(f"{'note' if unpublished.code == 0 else 'error'}: {unpublished}", file=sys.stderr)
        return unpublished.code
    return 0


class _Unpublished(Exception):
    """The staging directory is not an engine to publish (a dry run, a rank missing); the exit status to return."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def _world_size(argv: list[str]) -> int:
    """The rank count of the checkpoint being built (its config.json, checked by check_checkpoint)."""
    config = read_config(_flag_value(argv, "--checkpoint_dir"), True) or {}
    mapping = config.get("mapping") or {}
    return int(mapping.get("world_size") or int(mapping.get("tp_size", 1)) * int(mapping.get("pp_size", 1)))


def missing_engine_files(directory: Path, argv: list[str]) -> list[str]:
    """The files of a complete engine (config.json, a ``rank{N}.engine`` per rank) that ``directory`` lacks."""
    expected = ["config.json", *(f"rank{rank}.engine" for rank in range(_world_size(argv)))]
    return [name for name in expected if not (directory / name).is_file()]


if __name__ == "__main__":
    sys.exit(main())
