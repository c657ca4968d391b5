from .session import Session, TensorInfo  # noqa: F401
