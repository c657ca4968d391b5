"""Child side of the kill tests: run one example CLI in a process the test can SIGKILL.

Children are forked from a forkserver that has already imported torch and transformers, so
a start costs a fraction of a second instead of the seconds a fresh interpreter needs, and
no OpenMP pool is ever forked (the forkserver never computes anything).

``slow=True`` slows every file write down (4 KiB chunks with a pause between them, and a
pause inside every safetensors save), so random kills land inside writes often.
"""

from __future__ import annotations

import os
import sys
import time

#: Imported once by the forkserver: everything the CLIs import on the way to their work, so a
#: child starts in a fraction of a second (the first model load alone imports ~2 s of modules).
PRELOAD = ["torch", "transformers", "transformers.models.auto.auto_factory", "transformers.modeling_layers",
           "transformers.processing_utils", "transformers.models.auto.tokenization_auto",
           "transformers.models.qwen3.modeling_qwen3", "transformers.models.llama.modeling_llama",
           "transformers.tokenization_utils_fast", "accelerate.hooks", "jinja2", "safetensors.torch", "tqdm.auto",
           "tensorrt_llm_dflash.drafter", "tensorrt_llm_dflash.target", "tensorrt_llm_dflash.proposer",
           "tensorrt_llm_dflash.decode", "tensorrt_llm_dflash.training.trainer", "tensorrt_llm_dflash.training.data",
           "tensorrt_llm_dflash.training.prompts", "tensorrt_llm_dflash.training.workdir",
           "tensorrt_llm_dflash.trtllm.weight", "kill_child"]
CHUNK = 4096
PAUSE_S = 0.002


class SlowFile:
    """A file whose writes trickle out in chunks, as on a slow disk."""

    def __init__(self, f) -> None:
        self._f = f

    def write(self, data):
        for start in range(0, len(data), CHUNK):
            self._f.write(data[start:start + CHUNK])
            time.sleep(PAUSE_S)
        return len(data)

    def __getattr__(self, name):
        return getattr(self._f, name)


def _slow_down_writes() -> None:
    import safetensors.torch

    from tensorrt_llm_dflash import files

    files._write_stream = lambda f, write: write(SlowFile(f))
    real_save_file = safetensors.torch.save_file

    def slow_save_file(tensors, filename, metadata=None):
        time.sleep(25 * PAUSE_S)
        real_save_file(tensors, filename, metadata=metadata)
        time.sleep(25 * PAUSE_S)

    safetensors.torch.save_file = slow_save_file


def run_cli(script: str, argv: list[str], log_path: str, slow: bool) -> None:
    """Run ``examples/<script>.py`` main(argv); the exit status is the process's."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    import threading

    import torch
    from tqdm.std import tqdm

    torch.set_num_threads(1)
    tqdm.set_lock(threading.RLock())  # tqdm's default multiprocessing lock would outlive a killed child
    if slow:
        _slow_down_writes()
    from example_cli import load_example

    rc = load_example(script).main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
