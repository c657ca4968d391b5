"""A recorded TensorRT network, and its evaluation on the emulated device.

A layer is either a call of a module-level function ``fn(values, attrs) -> [outputs]``
(the stand-in ``tensorrt_llm.functional`` builds these), or a plugin object (V3
plugins and the GPT attention plugin) with ``get_output_shapes`` / ``infer`` /
``enqueue``. Evaluation:

1. shape inference on meta tensors: network inputs become meta tensors of the set
   shapes; a layer computes on real values only where all of its inputs are real (shape
   arithmetic: ``shape()``, constants, ``concat`` of dimensions ...), which is what
   TensorRT evaluates on the host. A shape argument (the target of a ``view``, the size of
   a ``slice`` ...) computed from execution data is refused (:class:`DataDependentShape`).
2. execution of the layers that reach a marked output (TensorRT removes the others), in
   a random topological order drawn from a seed (:func:`schedule`): only data dependencies
   order layers, as in TensorRT, so a plugin that writes memory behind TensorRT's back (the
   KV cache) must be ordered by a tensor dependency or the emulation shows the race.
"""

from __future__ import annotations

import copy
import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .core import DataDependentShape, EmulationError, device_memory, physical_dtype

#: Fill for buffers TensorRT hands out uninitialised: reading one shows up.
UNINITIALISED_INT = -0x5A5A5A5A
UNINITIALISED_FLOAT = float("nan")


@dataclass
class TensorRecord:
    tid: int
    name: str
    dtype: str
    shape: tuple[int, ...]
    producer: int | None = None
    index: int = 0
    is_input: bool = False
    is_output: bool = False
    location: int = 0  # tensorrt.TensorLocation value
    dim_names: dict[int, str] = field(default_factory=dict)
    forced_dtype: str | None = None


@dataclass
class LayerRecord:
    lid: int
    kind: str
    name: str
    fn: Callable | None
    inputs: list[int | None]
    outputs: list[int]
    attrs: dict
    plugin: Any = None
    plugin_key: tuple[str, str, str, dict] | None = None  # (name, version, namespace, fields)
    shape_args: tuple[int, ...] = ()
    precision: str | None = None


class Graph:
    def __init__(self) -> None:
        self.tensors: list[TensorRecord] = []
        self.layers: list[LayerRecord] = []
        self.inputs: list[int] = []
        self.outputs: list[int] = []

    # -- construction -------------------------------------------------------------------
    def _new_tensor(self, name: str, dtype: str, shape: tuple[int, ...], **kw: Any) -> TensorRecord:
        record = TensorRecord(len(self.tensors), name, dtype, tuple(shape), **kw)
        self.tensors.append(record)
        return record

    def add_input(self, name: str, dtype: str, shape: tuple[int, ...]) -> TensorRecord:
        if any(self.tensors[t].name == name for t in self.inputs):
            raise EmulationError(f"network already has an input named {name!r}")
        record = self._new_tensor(name, dtype, shape, is_input=True)
        self.inputs.append(record.tid)
        return record

    def add_layer(self, *, kind: str, fn: Callable | None, inputs: list[int | None],
                  outputs: list[tuple[str, tuple[int, ...]]], attrs: dict, plugin: Any = None,
                  shape_args: tuple[int, ...] = ()) -> LayerRecord:
        lid = len(self.layers)
        out_ids = [self._new_tensor(f"({kind} {lid})_output_{i}", dt, tuple(sh), producer=lid, index=i).tid
                   for i, (dt, sh) in enumerate(outputs)]
        layer = LayerRecord(lid, kind, f"{kind}_{lid}", fn, list(inputs), out_ids, attrs, plugin=plugin,
                            shape_args=tuple(shape_args))
        self.layers.append(layer)
        return layer

    def rename(self, record: TensorRecord, name: str) -> None:
        if record.is_input or record.is_output:
            for tid in self.inputs + self.outputs:
                other = self.tensors[tid]
                if other is not record and other.name == name:
                    raise EmulationError(f"two network I/O tensors would be named {name!r}")
        record.name = str(name)

    def mark_output(self, record: TensorRecord) -> None:
        if record.is_input:
            raise EmulationError(f"{record.name!r} is a network input and cannot be marked as an output")
        if not record.is_output:
            record.is_output = True
            self.outputs.append(record.tid)

    def unmark_output(self, record: TensorRecord) -> None:
        if record.is_output:
            record.is_output = False
            self.outputs.remove(record.tid)

    def io_record(self, name: str) -> TensorRecord | None:
        for tid in self.inputs + self.outputs:
            if self.tensors[tid].name == name:
                return self.tensors[tid]
        return None

    # -- build ----------------------------------------------------------------------------
    def live_layers(self) -> list[LayerRecord]:
        """Layers a marked output depends on (TensorRT removes dead layers)."""
        by_lid = {layer.lid: layer for layer in self.layers}
        needed: set[int] = set()
        stack = list(self.outputs)
        while stack:
            tid = stack.pop()
            producer = self.tensors[tid].producer
            if producer is None or producer in needed:
                continue
            needed.add(producer)
            stack.extend(t for t in by_lid[producer].inputs if t is not None)
        return [layer for layer in self.layers if layer.lid in needed]

    def validate(self, profiles: list[Any]) -> list[str]:
        problems: list[str] = []
        if not self.outputs:
            problems.append("the network has no outputs")
        names = [self.tensors[t].name for t in self.inputs + self.outputs]
        for name in sorted({n for n in names if names.count(n) > 1}):
            problems.append(f"two network I/O tensors are named {name!r}")
        if not profiles:
            problems.append("no optimization profile was defined")
        for tid in self.inputs:
            record = self.tensors[tid]
            if record.location != 0:
                problems.append(f"input {record.name!r}: the location must always be kDEVICE since TensorRT 10.0 "
                                "(ITensor::setLocation is deprecated; host inputs go through plugins as addresses)")
            for index, profile in enumerate(profiles):
                shapes = profile.shapes.get(record.name)
                if shapes is None:
                    problems.append(f"optimization profile {index} has no shape for input {record.name!r}")
                    continue
                for which in shapes:
                    if len(which) != len(record.shape) or any(
                            s != -1 and s != w for s, w in zip(record.shape, which)):
                        problems.append(f"optimization profile {index}: {record.name!r} shape {which} does not "
                                        f"fit the declared {record.shape}")
                        break
        for layer in self.layers:
            for i, tid in enumerate(layer.inputs):
                if tid is not None and tid >= len(self.tensors):
                    problems.append(f"layer {layer.name} input {i} is not a tensor of this network")
        return problems

    def time_plugins(self, profiles: list[Any]) -> None:
        """Run every live plugin layer once on builder-owned buffers at the opt shapes of
        each profile (TensorRT's auto-tuner times plugins with its own, uninitialised memory)."""
        for profile in profiles:
            opt = {name: shapes[1] for name, shapes in profile.shapes.items()}
            shapes = self.infer_shapes(opt, lenient=True)
            for layer in self.live_layers():
                if layer.plugin is None:
                    continue
                in_shapes = [None if t is None else shapes.get(t) for t in layer.inputs]
                if any(t is not None and s is None for t, s in zip(layer.inputs, in_shapes)):
                    continue
                inputs = [None if s is None else _scratch(self.tensors[t].dtype, s, random_fill=True)
                          for t, s in zip(layer.inputs, in_shapes)]
                outputs = [_scratch(self.tensors[t].dtype, shapes[t], random_fill=True) if t in shapes else None
                           for t in layer.outputs]
                if any(o is None for o in outputs):
                    continue
                status = layer.plugin.enqueue(inputs, outputs)
                if status != 0:
                    raise EmulationError(f"plugin layer {layer.name} ({_plugin_label(layer)}) failed while the "
                                         f"builder timed it (enqueue returned {status})")

    def freeze(self) -> Graph:
        """A picklable copy: plugin objects are replaced by (name, version, namespace, fields)."""
        frozen = copy.copy(self)
        frozen.tensors = [copy.deepcopy(t) for t in self.tensors]
        frozen.inputs, frozen.outputs = list(self.inputs), list(self.outputs)
        frozen.layers = []
        for layer in self.live_layers():
            clone = copy.copy(layer)
            if layer.plugin is not None:
                plugin = layer.plugin
                clone.plugin_key = (plugin.plugin_name, plugin.plugin_version, plugin.plugin_namespace,
                                    {f.name: f.data for f in plugin.get_fields_to_serialize()})
                clone.plugin = None
            frozen.layers.append(clone)
        return frozen

    def recreate_plugins(self, registry: Any, phase: Any) -> None:
        import tensorrt as trt

        for layer in self.layers:
            if layer.plugin_key is None:
                continue
            name, version, namespace, fields = layer.plugin_key
            creator = registry.get_creator(name, version, namespace)
            if creator is None:
                raise EmulationError(
                    f"IPluginRegistry::getCreator: Cannot find plugin: {name}, version: {version}, "
                    f"namespace: {namespace!r} (load the plugin library before deserializing the engine)")
            collection = trt.PluginFieldCollection(
                [trt.PluginField(k, v, trt.PluginFieldType.INT32) for k, v in fields.items()])
            layer.plugin = creator.create_plugin(name, collection, phase)
            if layer.plugin is None:
                raise EmulationError(f"{name} refused its serialized fields {fields}")

    # -- shape inference ------------------------------------------------------------------
    def infer_shapes(self, input_shapes: dict[str, tuple[int, ...]], lenient: bool = False) -> dict[int, tuple]:
        """Shapes of every tensor for these input shapes (TensorRT's shape inference).

        Layers run on zero-filled stand-ins of the inputs (fast on tiny tensors; a layer that
        fails on zeros is retried on meta tensors), while a flag per value tracks whether it
        derives from execution data: a shape argument that does is refused, as TensorRT
        refuses data-dependent shapes. Plugins only report their output shapes."""
        values: dict[int, tuple[torch.Tensor, bool] | None] = {}
        for tid in self.inputs:
            record = self.tensors[tid]
            shape = input_shapes.get(record.name)
            values[tid] = None if shape is None else (
                torch.zeros(tuple(shape), dtype=physical_dtype(record.dtype)), True)
        layers = self.layers if lenient else self.live_layers()
        for layer in layers:
            args = [None if t is None else values.get(t) for t in layer.inputs]
            if any(t is not None and a is None for t, a in zip(layer.inputs, args)):
                for t in layer.outputs:
                    values[t] = None
                continue
            try:
                outs = _infer_layer(self, layer, args)
            except EmulationError:
                if not lenient:
                    raise
                outs = [None] * len(layer.outputs)
            for t, v in zip(layer.outputs, outs):
                values[t] = v
        return {t: tuple(v[0].shape) for t, v in values.items() if v is not None}


def _infer_layer(graph: Graph, layer: LayerRecord, args: list) -> list:
    tensors = [None if a is None else a[0] for a in args]
    if layer.plugin is not None:
        shapes = layer.plugin.infer_output_shapes(tensors)
        return [(torch.zeros(tuple(s), dtype=physical_dtype(graph.tensors[t].dtype)), True)
                for s, t in zip(shapes, layer.outputs)]
    for i in layer.shape_args:
        if args[i] is not None and args[i][1]:
            raise DataDependentShape(f"layer {layer.name} ({layer.kind}): input {i} is a shape argument computed "
                                     "from execution data")
    data = layer.kind != "SHAPE" and any(a is not None and a[1] for i, a in enumerate(args)
                                         if i not in layer.shape_args)
    infer = getattr(layer.fn, "infer", None)
    if infer is not None:  # a kernel with side effects (a collective): its output shapes only
        return [(torch.zeros(shape, dtype=physical_dtype(graph.tensors[t].dtype)), data)
                for shape, t in zip(infer([None if a is None else tuple(a.shape) for a in tensors], layer.attrs),
                                    layer.outputs)]
    try:
        outs = _run_layer(graph, layer, tensors, meta=False)
    except (EmulationError, RuntimeError, ValueError, IndexError, ZeroDivisionError):
        if not data:
            raise
        # The zeros were not valid data (an index of -1 ...): shapes only, on meta tensors.
        meta_args = [t if i in layer.shape_args else _to_meta(t) for i, t in enumerate(tensors)]
        outs = _run_layer(graph, layer, meta_args, meta=True)
    return [(out, data) for out in outs]


def _plugin_label(layer: LayerRecord) -> str:
    plugin = layer.plugin
    return f"{plugin.plugin_namespace}::{plugin.plugin_name}" if plugin is not None else layer.kind


def _scratch(dtype: str, shape: tuple[int, ...], random_fill: bool) -> torch.Tensor:
    phys = physical_dtype(dtype)
    if phys.is_floating_point:
        tensor = (torch.randn(shape, dtype=torch.float32) * 1e3).to(phys) if random_fill else \
            torch.full(shape, UNINITIALISED_FLOAT, dtype=phys)
    elif phys == torch.bool:
        tensor = torch.randint(0, 2, shape).bool()
    else:
        info = torch.iinfo(phys)
        tensor = torch.randint(max(info.min, -2**62), min(info.max, 2**62), shape, dtype=torch.int64).to(phys) \
            if random_fill else torch.full(shape, max(UNINITIALISED_INT, info.min), dtype=phys)
    device_memory.register(tensor)
    return tensor


def _to_meta(value: torch.Tensor | None) -> torch.Tensor | None:
    if value is None or value.device.type == "meta":
        return value
    return torch.empty(value.shape, dtype=value.dtype, device="meta")


def _run_layer(graph: Graph, layer: LayerRecord, args: list[torch.Tensor | None], meta: bool,
               out_buffers: list[torch.Tensor | None] | None = None,
               out_shapes: list[tuple] | None = None) -> list[torch.Tensor]:
    """One layer on meta tensors (shape inference) or real ones (execution)."""
    if layer.plugin is not None:
        if meta:
            shapes = layer.plugin.infer_output_shapes(args)
            return [torch.empty(tuple(s), dtype=physical_dtype(graph.tensors[t].dtype), device="meta")
                    for s, t in zip(shapes, layer.outputs)]
        outs = [b if b is not None else _scratch(graph.tensors[t].dtype, s, random_fill=False)
                for b, t, s in zip(out_buffers, layer.outputs, out_shapes)]
        status = layer.plugin.enqueue(args, outs)
        if status != 0:
            raise EmulationError(f"plugin layer {layer.name} ({_plugin_label(layer)}) failed: enqueue returned {status}")
        return outs
    if meta:
        data_meta = any(a is not None and a.device.type == "meta"
                        for i, a in enumerate(args) if i not in layer.shape_args)
        for i in layer.shape_args:
            if args[i] is not None and args[i].device.type == "meta":
                raise DataDependentShape(f"layer {layer.name} ({layer.kind}): input {i} is a shape argument "
                                         "computed from execution data")
        if data_meta:
            args = [a if i in layer.shape_args else _to_meta(a) for i, a in enumerate(args)]
    outs = layer.fn(args, layer.attrs)
    result = []
    for t, out in zip(layer.outputs, outs):
        record = graph.tensors[t]
        want = physical_dtype(record.forced_dtype or record.dtype)
        result.append(out if out.dtype == want else out.to(want))
    return result


def _plan(graph: Graph) -> tuple[dict[int, LayerRecord], dict[int, int], dict[int, list[int]]]:
    plan = getattr(graph, "_plan_cache", None)
    if plan is None:
        live = graph.live_layers()
        by_id = {layer.lid: layer for layer in live}
        pending: dict[int, int] = {}
        consumers: dict[int, list[int]] = {}
        for layer in live:
            deps = {graph.tensors[t].producer for t in layer.inputs if t is not None} - {None}
            deps &= set(by_id)
            pending[layer.lid] = len(deps)
            for d in deps:
                consumers.setdefault(d, []).append(layer.lid)
        plan = (by_id, pending, consumers)
        graph._plan_cache = plan
    return plan


def schedule(graph: Graph, seed: int) -> list[int]:
    """An execution order of the live layers: creation order (seed 0), else a random valid
    topological order, TensorRT's freedom: odd seeds pick among the ready layers by random
    priority; even seeds run layers on demand (depth first from the outputs, in a random
    order of the outputs), so a layer whose result only a late output needs runs late."""
    by_id, pending0, consumers = _plan(graph)
    if not seed:
        return sorted(by_id)
    rng = random.Random(seed)
    if seed % 2:
        priority = {lid: rng.random() for lid in by_id}
        pending = dict(pending0)
        ready = [(priority[lid], lid) for lid, n in pending.items() if n == 0]
        heapq.heapify(ready)
        order = []
        while ready:
            _, lid = heapq.heappop(ready)
            order.append(lid)
            for c in consumers.get(lid, []):
                pending[c] -= 1
                if pending[c] == 0:
                    heapq.heappush(ready, (priority[c], c))
        return order
    outputs = list(graph.outputs)
    rng.shuffle(outputs)
    order, done = [], set()
    for root in outputs:
        producer = graph.tensors[root].producer
        stack = [(producer, False)] if producer is not None else []
        while stack:
            lid, expanded = stack.pop()
            if lid in done:
                continue
            if expanded:
                done.add(lid)
                order.append(lid)
                continue
            stack.append((lid, True))
            deps = [graph.tensors[t].producer for t in by_id[lid].inputs if t is not None]
            stack.extend((d, False) for d in reversed(deps) if d is not None and d not in done)
    return order


def evaluate(graph: Graph, bound: dict[int, torch.Tensor], shapes: dict[int, tuple], seed: int = 0) -> None:
    """Execute the live layers on the bound tensors; network outputs are written in place."""
    values: dict[int, torch.Tensor] = {t: bound[t] for t in graph.inputs}
    by_id, _, _ = _plan(graph)
    order = schedule(graph, seed)
    if len(order) != len(by_id):
        raise EmulationError("the network has a cycle")
    for lid in order:
        layer = by_id[lid]
        args = [None if t is None else values[t] for t in layer.inputs]
        out_buffers = [bound.get(t) for t in layer.outputs]
        outs = _run_layer(graph, layer, args, meta=False, out_buffers=out_buffers,
                          out_shapes=[shapes[t] for t in layer.outputs])
        for t, out in zip(layer.outputs, outs):
            if tuple(out.shape) != tuple(shapes[t]):
                raise EmulationError(f"layer {layer.name} ({layer.kind}) produced {tuple(out.shape)} for output "
                                     f"{graph.tensors[t].name!r}, shape inference said {shapes[t]}")
            target = bound.get(t)
            if target is not None and out is not target:
                target.copy_(out)
                out = target
            values[t] = out
