# modelkeeper's one image: `modelkeeper api` by default; docker-compose.temporal.yml runs
# the worker and gateway from it too by overriding the command.
FROM python:3.11.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src

# Exact versions come from constraints.txt; pyproject.toml only states ranges.
COPY pyproject.toml README.md constraints.txt ./
COPY modelkeeper ./modelkeeper
COPY workflows ./workflows
COPY activities ./activities
COPY worker ./worker
COPY api ./api
COPY agent ./agent
COPY gateway ./gateway
COPY cli ./cli

RUN pip install --no-cache-dir -c constraints.txt . \
    && useradd --create-home --uid 10001 --user-group modelkeeper

USER modelkeeper
WORKDIR /home/modelkeeper

EXPOSE 8400 8401

# No ENTRYPOINT: Compose's `command: ["modelkeeper", "worker"]` replaces this whole line.
CMD ["modelkeeper", "api"]
