"""Stand-in for ``tensorrt_llm/module.py`` (NVIDIA/TensorRT-LLM @ 000a01de66f0eab4ab05640711f0253f50f5209c)."""

from __future__ import annotations


class Module:
    def __init__(self) -> None:
        self._modules = {}
        self._parameters = {}
        self._network_outputs = {}

    def forward(self, *args, **kwargs):
        raise NotImplementedError

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def __getattr__(self, name):
        parameters = self.__dict__.get("_parameters")
        if parameters is not None and name in parameters:
            return parameters[name]
        modules = self.__dict__.get("_modules")
        if modules is not None and name in modules:
            return modules[name]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __setattr__(self, name, value) -> None:
        from .parameter import Parameter

        if isinstance(value, (Parameter, Module)):
            if name in self.__dict__:
                del self.__dict__[name]
            (self._parameters if isinstance(value, Parameter) else self._modules)[name] = value
        else:
            super().__setattr__(name, value)

    def named_modules(self, memo=None, prefix="", remove_duplicate=True):
        if memo is None:
            memo = set()
        if self not in memo:
            if remove_duplicate:
                memo.add(self)
            yield prefix, self
            for name, module in self._modules.items():
                if module is None:
                    continue
                yield from module.named_modules(memo, prefix + ("." if prefix else "") + name, remove_duplicate)

    def named_children(self):
        yield from self._modules.items()

    def children(self):
        for _, module in self._modules.items():
            yield module

    def named_parameters(self, prefix="", recurse=True):
        seen = set()
        for module_prefix, module in self.named_modules(prefix=prefix):
            for name, param in module._parameters.items():
                if param is None or id(param) in seen:
                    continue
                seen.add(id(param))
                yield module_prefix + ("." if module_prefix else "") + name, param

    def parameters(self, recurse=True):
        for _, param in self.named_parameters():
            yield param

    def register_parameter(self, name, param):
        self._parameters[name] = param

    def register_network_output(self, name, value):
        self._network_outputs[name] = value

    def named_network_outputs(self):
        for name, module in self.named_modules():
            for n, output in module._network_outputs.items():
                yield name + ("." if name else "") + n, output

    def __hash__(self):
        return id(self)


class ModuleList(Module):
    def __init__(self, modules) -> None:
        super().__init__()
        for i, module in enumerate(modules):
            self._modules[str(i)] = module

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return ModuleList(list(self._modules.values())[idx])
        if idx < 0:
            idx += len(self)
        if not 0 <= idx < len(self):
            raise IndexError(idx)
        return self._modules[str(idx)]

    def __setitem__(self, idx, module) -> None:
        self._modules[str(idx)] = module

    def __len__(self):
        return len(self._modules)
