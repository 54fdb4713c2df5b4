"""Tensor parallelism over torch.distributed (role of vllm/distributed/)."""
from pyengine.distributed.parallel_state import (
                                                 GroupCoordinator,
                                                 get_distributed_init_method,
                                                 get_open_port,
                                                 init_distributed_environment,
)

__all__ = ["GroupCoordinator", "get_distributed_init_method", "get_open_port", "init_distributed_environment"]
