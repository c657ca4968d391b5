"""Stand-in for ``tensorrt_llm/_common.py`` (NVIDIA/TensorRT-LLM @ 0fccc5b97dd7b23c438e740b3bf4dcde607266c4)."""

from __future__ import annotations

import contextlib
import functools
import os

net = None


def default_net():
    assert net, "Use builder to create network first, and use `set_network` or `net_guard` to set it to default"
    return net


def default_trtnet():
    return default_net().trt_network


def set_network(network):
    global net
    net = network


def switch_net_dtype(cur_dtype):
    prev_dtype = default_net().dtype
    default_net().dtype = cur_dtype
    return prev_dtype


@contextlib.contextmanager
def precision(dtype):
    from ._utils import str_dtype_to_trt

    if isinstance(dtype, str):
        dtype = str_dtype_to_trt(dtype)
    prev_dtype = switch_net_dtype(dtype)
    yield
    switch_net_dtype(prev_dtype)


class _BuildingFlag:
    """Sets ``IS_BUILDING=1`` while TensorRT builds (plugins skip their kernels then)."""

    def __enter__(self):
        os.environ["IS_BUILDING"] = "1"

    def __exit__(self, exc_type, exc_value, traceback):
        del os.environ["IS_BUILDING"]


def _is_building(f):
    @functools.wraps(f)
    def decorated(*args, **kwargs):
        with _BuildingFlag():
            return f(*args, **kwargs)

    return decorated


def check_max_num_tokens(max_num_tokens, opt_num_tokens, max_batch_size, max_input_len, max_seq_len, max_beam_width,
                         remove_input_padding, enable_context_fmha, tokens_per_block, multiple_profiles):
    if not remove_input_padding:
        if max_num_tokens is not None or opt_num_tokens is not None:
            max_num_tokens = max_batch_size * max_seq_len
        return max_num_tokens, opt_num_tokens
    if max_num_tokens is None:
        max_num_tokens = max_seq_len * max_batch_size
    if opt_num_tokens is None and not multiple_profiles:
        opt_num_tokens = min(max_batch_size * max_beam_width, max_num_tokens)
    if max_num_tokens > max_seq_len * max_batch_size:
        max_num_tokens = max_seq_len * max_batch_size
    if max_num_tokens < max_input_len and not enable_context_fmha:
        max_num_tokens = max_input_len
    elif max_num_tokens < tokens_per_block and enable_context_fmha:
        max_num_tokens = tokens_per_block
    if opt_num_tokens is not None and opt_num_tokens > max_num_tokens:
        opt_num_tokens = max_num_tokens
    return max_num_tokens, opt_num_tokens
