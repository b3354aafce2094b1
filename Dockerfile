FROM python:3.11-slim
RUN pip install --no-cache-dir uv
WORKDIR /app
COPY . .
RUN uv sync --frozen --no-dev && ln -s /app/.venv/bin/jetshard /usr/local/bin/jetshard
ENV PATH="/app/.venv/bin:$PATH"
