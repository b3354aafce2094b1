"""OpenAI's dialect: /v1/chat/completions, /v1/completions, /v1/embeddings and /v1/models."""
