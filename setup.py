"""setuptools hook: ship tensorrt_llm_dflash-trtllm-build.pth at the top of site-packages.

Everything else is in pyproject.toml. The .pth makes TensorRT-LLM's own ``trtllm-build``
accept ``--speculative_decoding_mode dflash`` (tensorrt_llm_dflash/trtllm/hook.py explains
why this package does not install a ``trtllm-build`` script of its own). Editable installs
(``pip install -e .``) do not carry it; there, use ``dflash-trtllm-build``.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "tensorrt_llm_dflash-trtllm-build.pth"
SOURCE = Path(__file__).resolve().parent / "tensorrt_llm_dflash" / "trtllm" / PTH


class BuildPyWithPth(build_py):
    def run(self) -> None:
        super().run()
        if not getattr(self, "editable_mode", False):
            self.copy_file(str(SOURCE), str(Path(self.build_lib) / PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = super().get_outputs(include_bytecode)
        if not getattr(self, "editable_mode", False):
            outputs.append(str(Path(self.build_lib) / PTH))
        return outputs


setup(cmdclass={"build_py": BuildPyWithPth})
