"""DFlash block-diffusion drafting and DDTree draft trees for TensorRT-LLM and PyTorch."""

__version__ = "0.1.0"
