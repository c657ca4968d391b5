from .attention import (  # noqa: F401
    Attention,
    AttentionParams,
    KeyValueCacheParams,
    MropeParams,
    SpecDecodingParams,
)
from .embedding import Embedding  # noqa: F401
from .linear import ColumnLinear, Linear, RowLinear  # noqa: F401
from .mlp import MLP, GatedMLP  # noqa: F401
from .normalization import RmsNorm  # noqa: F401
