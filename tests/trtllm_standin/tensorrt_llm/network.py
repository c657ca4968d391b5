"""Stand-in for ``tensorrt_llm/network.py`` (NVIDIA/TensorRT-LLM @ 138f96d45f90b9667426f7c47297d8c06bafac73,
newest text index id 146503238): ``Network`` and ``net_guard``."""

from __future__ import annotations

import contextlib

import tensorrt as trt

from ._common import set_network


class Network:
    def __init__(self, **kwargs):
        # Upstream too: use Builder.create_network(), which calls _init.
        pass

    def _init(self, trt_network):
        from .plugin.plugin import PluginConfig

        self._trt_network = trt_network
        self._inputs = {}
        self._named_parameters = None
        self._dtype = None
        self._plugin_config = PluginConfig()
        self._strongly_typed = trt_network.get_flag(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
        return self

    @property
    def dtype(self):
        return self._dtype

    @dtype.setter
    def dtype(self, dtype):
        assert isinstance(dtype, trt.DataType) or dtype is None
        self._dtype = dtype

    @property
    def trt_network(self):
        return self._trt_network

    @property
    def plugin_config(self):
        return self._plugin_config

    @plugin_config.setter
    def plugin_config(self, cfg):
        from .plugin.plugin import PluginConfig

        assert isinstance(cfg, PluginConfig), f"Expecting a PluginConfig object, got {type(cfg)}"
        self._plugin_config = cfg

    @property
    def strongly_typed(self):
        return self._strongly_typed

    @property
    def named_parameters(self):
        return self._named_parameters

    def set_named_parameters(self, named_parameters):
        self._named_parameters = named_parameters

    def _add_input(self, tensor, name, dtype, shape, dim_range=None):
        assert isinstance(dtype, trt.DataType)
        tensor.trt_tensor = self._trt_network.add_input(name=name, shape=shape, dtype=dtype)
        if dim_range is not None:
            for i, dim_name in enumerate(dim_range.keys()):
                tensor.trt_tensor.set_dimension_name(i, str(dim_name))
        self._inputs[name] = tensor

    def _mark_output(self, tensor, name, dtype):
        from .functional import cast

        if dtype is not None and self._strongly_typed:
            tensor = cast(tensor, dtype)
        self._trt_network.mark_output(tensor.trt_tensor)
        tensor.trt_tensor.name = name
        if not self._strongly_typed:
            tensor.trt_tensor.dtype = dtype or tensor.trt_tensor.dtype

    def get_inputs(self):
        return list(self._inputs.values())

    def _set_layer_name(self, layer):
        return layer


@contextlib.contextmanager
def net_guard(network):
    from ._common import net as previous

    assert isinstance(network, Network), f"Invalid network, can only guard Network instance, got: {network}"
    set_network(network)
    try:
        yield
    finally:
        set_network(previous)
