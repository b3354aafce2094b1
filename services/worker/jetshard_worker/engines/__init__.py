"""The engines a runner can drive: MLX (in process) and llama.cpp (upstream `llama-server`, a child process)."""
