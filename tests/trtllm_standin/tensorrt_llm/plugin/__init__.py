from .plugin import PluginConfig, current_all_reduce_helper, init_all_reduce_helper  # noqa: F401
