"""Model implementations, registry and weight loader."""
from pyengine.models.registry import ModelDims, get_model_cls, model_dims, supported_architectures

__all__ = ["ModelDims", "get_model_cls", "model_dims", "supported_architectures"]
