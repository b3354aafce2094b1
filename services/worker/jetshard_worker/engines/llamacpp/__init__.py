"""llama.cpp as an engine: upstream `llama-server`, one per instance, supervised by the instance's runner."""
