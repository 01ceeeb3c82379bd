# qmill server image. Build: docker build -t qmill .
# CUDA build (NVIDIA GPUs): docker build --build-arg JAX_EXTRA=cuda13 -t qmill:cuda .
# (JAX_EXTRA selects the jax[...] extra: "" for CPU, "cuda12" or "cuda13" for NVIDIA GPUs.)
# qmill extras: --build-arg QMILL_EXTRAS=postgres (the default: batch jobs in one PostgreSQL
# queue shared by the replicas, as deploy/ runs them), objectstore (gs:// and s3:// batch jobs),
# odml (ExportOdml, ~380 MB); comma-separated, e.g. postgres,objectstore.

ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
ARG JAX_EXTRA=""
ARG JAX_VERSION=0.10.2
ARG QMILL_EXTRAS="postgres"
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/qmill
ENV PATH=/opt/qmill/bin:$PATH
# Dependencies first: this layer is reused until pyproject.toml changes.
COPY pyproject.toml README.md ./
RUN python -c "import os, tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; extras = [e.strip() for e in os.environ['QMILL_EXTRAS'].split(',') if e.strip()]; print('\n'.join(p['dependencies'] + [r for e in extras for r in p['optional-dependencies'][e]]))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && if [ -n "$JAX_EXTRA" ]; then pip install "jax[${JAX_EXTRA}]==${JAX_VERSION}"; fi
COPY proto ./proto
COPY engine ./engine
COPY checkpoints ./checkpoints
COPY server ./server
COPY client ./client
COPY cli ./cli
RUN pip install --no-deps .

FROM python:${PYTHON_VERSION}-slim
COPY --from=build /opt/qmill /opt/qmill
# The user has no home (and deploy/ mounts the root read-only): XLA's compilation cache goes to
# /tmp (an emptyDir there, so a restarted container loads what the last one compiled).
ENV PATH=/opt/qmill/bin:$PATH PYTHONUNBUFFERED=1 QMILL_COMPILATION_CACHE=/tmp/qmill-xla
RUN useradd --system --uid 10001 --no-create-home qmill
USER 10001
# 50051: gRPC; 9464: Prometheus /metrics.
EXPOSE 50051 9464
# The gRPC health service answers SERVING once the server is up, NOT_SERVING while it drains.
# (It probes plaintext; with TLS, use the orchestrator's gRPC probe or --health-cmd instead.)
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import grpc, sys; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; s = g.HealthStub(grpc.insecure_channel('127.0.0.1:50051')); sys.exit(0 if s.Check(h.HealthCheckRequest(), timeout=4).status == h.HealthCheckResponse.SERVING else 1)"]
ENTRYPOINT ["qmill", "serve", "--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9464"]
# A non-loopback bind needs TLS or an explicit --insecure (e.g. behind a TLS-terminating mesh).
# For TLS and tokens, replace this with e.g.:
#   --tls-cert /certs/tls.crt --tls-key /certs/tls.key [--client-ca /certs/ca.crt] --tokens /etc/qmill/tokens.toml
CMD ["--insecure"]
