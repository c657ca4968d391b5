"""Stand-in for ``tensorrt_llm/runtime/session.py`` (NVIDIA/TensorRT-LLM @ 46d548bfa861186d863bfac38a50ba029de5ee58).

``run`` binds every tensor by address (``context.set_tensor_address(name, t.data_ptr())``)
and calls ``execute_async_v3``, exactly as upstream; binding a torch tensor registers it as
live emulated device memory (a GPU engine reads whatever memory the address names; the
emulated one only reads registered allocations).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import tensorrt as trt
import torch
from _emu import EmulationError, device_memory, physical_dtype


@dataclass
class TensorInfo:
    name: str
    dtype: trt.DataType
    shape: tuple


class Session:
    def __init__(self, **kwargs):
        pass

    def _init(self, engine_buffer=None):
        self._runtime = trt.Runtime(trt.Logger())
        if engine_buffer is not None:
            self._engine = self._runtime.deserialize_cuda_engine(engine_buffer)
        self._context = self._engine.create_execution_context()
        assert self._context is not None, "Failed to create an execution context!"
        self._context.set_optimization_profile_async(0, 0)
        return self

    @staticmethod
    def from_serialized_engine(engine):
        return Session()._init(engine)

    @staticmethod
    def from_engine(engine):
        session = Session()
        session._engine = engine
        return session._init()

    @property
    def runtime(self):
        return self._runtime

    @property
    def engine(self):
        return self._engine

    @property
    def context(self):
        return self._context

    def set_shapes(self, tensor_dict, context=None):
        context = context or self._context
        for i in range(self._engine.num_io_tensors):
            name = self._engine.get_tensor_name(i)
            if self._engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
                shape = tuple(tensor_dict[name].shape)
                if not context.set_input_shape(name, shape):
                    raise ValueError(f"Couldn't assign {name} with shape {shape}, engine supports [min, opt, max] = "
                                     f"{self._engine.get_tensor_profile_shape(name, context.active_optimization_profile)}")

    def infer_shapes(self, inputs: list[TensorInfo], context=None) -> list[TensorInfo]:
        context = context or self._context
        for info in inputs:
            if self._engine.get_tensor_mode(info.name) != trt.TensorIOMode.INPUT:
                raise ValueError(f"Tensor:{info.name} is not an input tensor")
            if self._engine.get_tensor_dtype(info.name) != info.dtype:
                raise ValueError(f"Tensor:{info.name} has wrong dtype")
            if not context.set_input_shape(info.name, info.shape):
                raise RuntimeError(f"Could not set shape {info.shape} for tensor {info.name}. Please check the "
                                   "profile range for which your model was build.")
        outputs = []
        for i in range(self._engine.num_io_tensors):
            name = self._engine.get_tensor_name(i)
            if self._engine.get_tensor_mode(name) == trt.TensorIOMode.OUTPUT:
                outputs.append(TensorInfo(name, self._engine.get_tensor_dtype(name), context.get_tensor_shape(name)))
        return outputs

    def run(self, inputs: dict[str, Any], outputs: dict[str, Any], stream, context=None) -> bool:
        context = context or self._context
        for tensor_name in list(inputs) + list(outputs):
            tensor = inputs[tensor_name] if tensor_name in inputs else outputs[tensor_name]
            if isinstance(tensor, torch.Tensor):
                # TensorRT reads the bytes as the engine's dtype whatever torch says they are:
                # a mismatch is a misread on a GPU; the stand-in refuses it by name.
                expected = physical_dtype(self._engine.get_tensor_dtype(tensor_name).value) \
                    if self._engine._graph.io_record(tensor_name) is not None else None
                if expected is not None and tensor.dtype != expected:
                    raise EmulationError(f"{tensor_name!r} is bound as {tensor.dtype}, the engine reads {expected}")
                device_memory.register(tensor)
                ptr = tensor.data_ptr()
            else:
                ptr = tensor
            context.set_tensor_address(tensor_name, ptr)
        return context.execute_async_v3(stream)
