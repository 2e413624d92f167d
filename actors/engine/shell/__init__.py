"""The engine's shell: the Ray actor, the asyncio loop around the core, output
processing (detokenizing, stop strings), metrics and chat templates.

See docs/architecture.md, "Layers".
"""
