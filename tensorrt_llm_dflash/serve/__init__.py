"""An OpenAI-compatible server for the DFlash/DDTree runtime (``python -m tensorrt_llm_dflash.serve``).

Layers, in nano-vllm's manner (docs/serving.md):

* :mod:`.api`: FastAPI app, OpenAI request/response shapes, SSE streaming, /health, /metrics;
* :mod:`.protocol`: request bodies and their checks (400 naming the field and the value);
* :mod:`.engine`: the scheduler; one thread owns the model and runs the step loop, rows admitted and
  retired at step boundaries (continuous batching), a bounded queue;
* :mod:`.sequence`: one request's output (stop tokens, length, stop strings, streaming text);
* :mod:`.runner`: the narrow ``BatchRunner`` protocol the engine drives, over the graphed runtime;
* :mod:`.metrics`: Prometheus text format.
"""

from .engine import Engine, EngineStopped, QueueFull
from .runner import BatchRunner, DecoderSpec, GraphedRunner, RowRequest, RowStep, graphed_rows

__all__ = ["BatchRunner", "DecoderSpec", "Engine", "EngineStopped", "GraphedRunner", "QueueFull", "RowRequest",
           "RowStep", "graphed_rows"]
