"""llama.cpp as an engine: upstream `llama-server` built from the tree vendored in PyPI's `llama-cpp-python` sdist
(`build`), checked on this CPU (`probe`), and run one process per instance by its runner (`server`, `engine`)."""
