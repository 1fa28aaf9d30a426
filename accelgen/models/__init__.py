from accelgen.models.embedded import EMBEDDED_MODELS, ModelNotInstalledError
from accelgen.models.loading import cache_dir, is_cached, load_model, resolve_device

__all__ = ["EMBEDDED_MODELS", "ModelNotInstalledError", "cache_dir", "is_cached", "load_model", "resolve_device"]
