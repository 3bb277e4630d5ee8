"""The serving engine: scheduler, memory-state cache, model runner, ``LLMEngine``
(docs/engine.md)."""
