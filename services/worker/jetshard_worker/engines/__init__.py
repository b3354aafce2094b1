"""The engines a runner drives; `jetshard_worker.engine` is MLX's (see ARCHITECTURE.md, Engines)."""
