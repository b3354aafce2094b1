"""The engines a runner can drive: MLX (in process; `jetshard_worker.engines.mlx`) and llama.cpp (upstream
`llama-server`, a child process of the runner)."""
