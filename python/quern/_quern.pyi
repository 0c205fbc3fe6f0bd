# Type stubs of the extension module behind the quern package.
from typing import Any, Callable, Optional

import numpy as np

class Cancellation:
    def cancel(self) -> None: ...
    @property
    def cancelled(self) -> bool: ...

class Engine:
    def __init__(self, model_repository: str, max_queue_wait_ms: int = 0, cores: int = 0) -> None: ...
    def infer(self, model: str, inputs: dict[str, np.ndarray], *, version: Optional[int] = None,
              priority: Optional[int] = None,
              timeout: Optional[float] = None) -> tuple[dict[str, np.ndarray], dict[str, Any]]: ...
    def infer_async(self, model: str, inputs: dict[str, np.ndarray],
                    done: Callable[[Optional[dict[str, np.ndarray]], Optional[dict[str, Any]], Optional[BaseException]],
                                   None],
                    *, version: Optional[int] = None, priority: Optional[int] = None,
                    timeout: Optional[float] = None) -> Cancellation: ...
    def register(self, name: str, fn: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]],
                 inputs: list[tuple[str, str, list[int]]], outputs: list[tuple[str, str, list[int]]],
                 max_batch_size: int, instances: int, max_queue_delay_us: int) -> None: ...
    def models(self) -> list[dict[str, Any]]: ...
