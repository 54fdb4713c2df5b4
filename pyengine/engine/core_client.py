"""Client side of the engine core (mirrors vllm/v1/engine/core_client.py). The in-process
client puts messages on EngineCoreProc's queues; a multi-process client would send the
same messages cbor2-encoded (pyengine.engine.messages.encode)."""
from __future__ import annotations

from typing import Optional, Union

from pyengine.config import EngineConfig
from pyengine.engine.core import EngineCoreProc
from pyengine.engine.messages import EngineCoreAbort, EngineCoreOutputs, EngineCoreRequest, EngineDeadMessage


class InprocClient:
    def __init__(self, config: EngineConfig):
        self.proc = EngineCoreProc(config)

    @property
    def engine_core(self):
        return self.proc.engine_core

    def add_request(self, request: EngineCoreRequest) -> None:
        self.proc.input_queue.put(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.proc.input_queue.put(EngineCoreAbort(list(request_ids)))

    def get_output(self, timeout: Optional[float] = None) -> Union[EngineCoreOutputs, EngineDeadMessage, None]:
        """Blocks for the next outputs; None on timeout or after shutdown."""
        import queue
        try:
            return self.proc.output_queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def wake_output_reader(self) -> None:
        self.proc.output_queue.put(None)

    def is_alive(self) -> bool:
        return self.proc.thread.is_alive()

    def shutdown(self) -> None:
        self.proc.shutdown()
