# dptrain on a CUDA PyTorch base image: every node runs the same environment.
#   docker build -t dptrain:0.1.0 .                       (JupyterLab too: --build-arg JUPYTER=1)
#   docker run --rm --gpus all --ipc=host -v "$PWD/runs:/workspace/runs" dptrain:0.1.0 run --out runs/demo
# See the README's "Deployment" section for the run lines (shared memory, volumes, Jupyter, SSH).
ARG BASE_IMAGE=pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

ARG JUPYTER=0
ARG UID=1000
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/dptrain
COPY pyproject.toml README.md ./
COPY src ./src
# The base image's torch (its CUDA build) is kept: it is the constraint of the install.
RUN python -c "import torch; print(f'torch=={torch.__version__}')" > /tmp/torch-constraint.txt \
    && python -m pip install --no-cache-dir -c /tmp/torch-constraint.txt . \
    && if [ "$JUPYTER" = 1 ]; then python -m pip install --no-cache-dir -c /tmp/torch-constraint.txt jupyterlab==4.6.6; fi \
    && rm /tmp/torch-constraint.txt \
    && python -c "import torch, dptrain; print('dptrain', dptrain.__version__, 'with torch', torch.__version__)"

# A non-root user (uid $UID) owns /workspace; mount runs/ and data/ there.
RUN if id -u "$UID" >/dev/null 2>&1; then userdel --remove "$(id -un "$UID")"; fi \
    && useradd --create-home --uid "$UID" --shell /bin/bash dptrain \
    && mkdir -p /workspace/runs /workspace/data \
    && chown -R dptrain:dptrain /workspace
# numeric, so that Kubernetes can verify runAsNonRoot
USER ${UID}
WORKDIR /workspace
ENTRYPOINT ["dptrain"]
CMD ["--help"]
