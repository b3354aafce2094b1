FROM python:3.11-slim
RUN pip install --no-cache-dir uv
WORKDIR /app
COPY . .
# With the `vision` extra (mlx-vlm): the image's worker serves vision models as well as text ones.
RUN uv sync --frozen --extra vision && ln -s /app/.venv/bin/jetshard /usr/local/bin/jetshard
ENV PATH="/app/.venv/bin:$PATH"
