"""The engine's pure core: requests, KV block accounting, scheduling, the step.

Plain Python (no torch, no Ray, no asyncio), driven one `EngineCore.step()` at a
time; see docs/architecture.md, "Layers".
"""
