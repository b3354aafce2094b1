"""Ollama's API under /api, for Ollama's clients."""
