"""The API's dialects: OpenAI (chat, completions, embeddings, models), the Responses API, Anthropic's Messages
and Ollama. Each package holds its wire types with their translation to and from the neutral `TaskRequest` and
chunks (`types`), and its routes (`routes`); what they share is here: the strict body (`strict_body`) and the
checks of every request's values (`checks`). Placement, queueing and cancellation are the shared request
path's (`jetshard_api.tasks`).
"""
