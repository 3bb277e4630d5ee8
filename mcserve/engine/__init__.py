"""The serving engine: scheduler, memory-state cache, model runner, ``LLMEngine`` (DESIGN.md §2)."""
