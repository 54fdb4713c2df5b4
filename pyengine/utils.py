"""Small process-level helpers."""
from __future__ import annotations

import gc


def freeze_gc_heap() -> None:
    """Collect, then move every object alive now (modules, the model, the tokenizer) into
    the garbage collector's permanent generation, so later collections scan only what
    serving allocates. Serving allocates several objects per token, and full collections
    over the start-up heap (hundreds of thousands of objects with torch and transformers
    loaded) were half the output handler's time on the H200 (docs/benchmarks.md). Mirrors
    vLLM's ``freeze_gc_heap`` after engine start-up."""
    gc.collect()
    gc.freeze()


def unfreeze_gc_heap() -> None:
    """Undo ``freeze_gc_heap`` when an engine shuts down, so what it leaves behind in
    reference cycles can be collected (a process may build many engines, as tests do)."""
    gc.unfreeze()
