"""The engines a runner can drive: MLX (in process; `jetshard_worker.engine`) and llama.cpp (upstream
`llama-server`, a child process of the runner)."""
