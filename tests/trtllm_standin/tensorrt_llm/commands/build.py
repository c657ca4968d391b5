"""Stand-in for ``tensorrt_llm/commands/build.py`` (``trtllm-build``; NVIDIA/TensorRT-LLM @
65f1d1536e18aea3380e6e270e00895a709333eb).

``parse_arguments`` returns the parser with upstream flag names, types, choices and
defaults for everything a DFlash build uses; ``main`` builds the ``BuildConfig`` the same
way, resolves the architecture through ``MODEL_MAP``, loads the checkpoint with
``from_checkpoint``, writes ``model_config.logits_dtype`` when ``--logits_dtype`` is given
(upstream's only config write besides the rank), and builds every rank, in ``spawn``
worker processes when ``--workers`` > 1 as ``parallel_build`` does.
"""

from __future__ import annotations

import argparse
import copy
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context

from ..builder import BuildConfig, build
from ..models import MODEL_MAP
from ..models.modeling_utils import PretrainedConfig, SpeculativeDecodingMode
from ..plugin.plugin import PluginConfig, add_plugin_argument


def parse_arguments():
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--checkpoint_dir", type=str, default=None)
    parser.add_argument("--model_config", type=str, default=None)
    parser.add_argument("--build_config", type=str, default=None)
    parser.add_argument("--model_cls_file", type=str, default=None)
    parser.add_argument("--model_cls_name", type=str, default=None)
    parser.add_argument("--output_dir", type=str, default="engine_outputs")
    parser.add_argument("--max_batch_size", type=int, default=2048)
    parser.add_argument("--max_input_len", type=int, default=1024)
    parser.add_argument("--max_seq_len", "--max_decoder_seq_len", dest="max_seq_len", type=int, default=None)
    parser.add_argument("--max_beam_width", type=int, default=1)
    parser.add_argument("--max_num_tokens", type=int, default=8192)
    parser.add_argument("--opt_num_tokens", type=int, default=None)
    parser.add_argument("--kv_cache_type", type=str, default=argparse.SUPPRESS,
                        choices=["continuous", "paged", "disabled"])
    parser.add_argument("--paged_kv_cache", type=str, default=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--log_level", type=str, default="info")
    parser.add_argument("--logits_dtype", type=str, default=None, choices=["float16", "float32"])
    parser.add_argument("--gather_context_logits", action="store_true", default=False)
    parser.add_argument("--dry_run", action="store_true", default=False)
    parser.add_argument("--speculative_decoding_mode", default=None,
                        choices=["draft_tokens_external", "lookahead_decoding", "medusa", "explicit_draft_tokens",
                                 "eagle"])
    parser.add_argument("--max_draft_len", type=int, default=0)
    add_plugin_argument(parser)
    return parser


def build_model(build_config: BuildConfig, rank: int = 0, ckpt_dir: str = None, model_config=None, model_cls=None,
                dry_run: bool = False, **kwargs):
    model_config = copy.deepcopy(model_config)
    logits_dtype = kwargs.get("logits_dtype")
    if logits_dtype is not None:
        model_config.logits_dtype = logits_dtype
    assert rank < model_config.mapping.world_size
    rank_config = copy.deepcopy(model_config)
    rank_config.set_rank(rank)
    if model_cls is None:
        assert model_config.architecture in MODEL_MAP, f"Unsupported model architecture: {model_config.architecture}"
        model_cls = MODEL_MAP[model_config.architecture]
    model = model_cls(rank_config) if ckpt_dir is None else model_cls.from_checkpoint(ckpt_dir, config=rank_config)
    return build(model, build_config)


def build_and_save(rank, gpu_id, ckpt_dir, build_config, output_dir, log_level, model_config, model_cls, **kwargs):
    engine = build_model(build_config, rank, ckpt_dir, model_config, model_cls=model_cls, **kwargs)
    assert engine is not None
    engine.save(output_dir)
    return True


def parallel_build(model_config: PretrainedConfig, ckpt_dir, build_config: BuildConfig, output_dir: str,
                   workers: int = 1, log_level: str = "info", model_cls=None, **kwargs):
    world_size = model_config.mapping.world_size
    if workers == 1:
        for rank in range(world_size):
            build_and_save(rank, rank % max(workers, 1), ckpt_dir, build_config, output_dir, log_level, model_config,
                           model_cls, **kwargs)
        return
    with ProcessPoolExecutor(mp_context=get_context("spawn"), max_workers=workers) as pool:
        futures = [pool.submit(build_and_save, rank, rank % workers, ckpt_dir, build_config, output_dir, log_level,
                               model_config, model_cls, **kwargs) for rank in range(world_size)]
        exceptions = []
        for future in as_completed(futures):
            try:
                future.result()
            except Exception as err:  # noqa: BLE001  (upstream collects every worker's failure)
                exceptions.append(err)
        assert not exceptions, f"Engine building failed, please check error log: {exceptions}"


def main():
    parser = parse_arguments()
    args = parser.parse_args()
    if args.gather_context_logits and args.max_draft_len > 0:
        raise RuntimeError("Gather context logits is not support with draft len > 0. If want to get the accepted "
                           "tokens' logits from target model, please just enable gather_generation_logits")
    os.makedirs(args.output_dir, exist_ok=True)
    from _emu.core import emulated_device_count

    workers = min(emulated_device_count(), args.workers)
    plugin_config = PluginConfig.from_arguments(args)
    plugin_config.validate()
    kwargs = {"logits_dtype": args.logits_dtype}
    speculative_decoding_mode = SpeculativeDecodingMode.from_arguments(args)
    assert args.checkpoint_dir is not None, "--checkpoint_dir is required"
    config_path = os.path.join(args.checkpoint_dir, "config.json")
    model_config = PretrainedConfig.from_json_file(config_path)
    build_config = BuildConfig.from_dict({
        "max_input_len": args.max_input_len, "max_seq_len": args.max_seq_len, "max_batch_size": args.max_batch_size,
        "max_beam_width": args.max_beam_width, "max_num_tokens": args.max_num_tokens,
        "opt_num_tokens": args.opt_num_tokens, "gather_context_logits": args.gather_context_logits,
        "strongly_typed": True, "max_draft_len": args.max_draft_len,
        "speculative_decoding_mode": speculative_decoding_mode, "dry_run": args.dry_run,
    }, plugin_config=plugin_config)
    if hasattr(args, "kv_cache_type"):
        build_config.update_from_dict({"kv_cache_type": args.kv_cache_type})
    parallel_build(model_config, args.checkpoint_dir, build_config, args.output_dir, workers, args.log_level,
                   None, **kwargs)
    return 0
