# Local stand-in for python:3.11-slim-bookworm, built from a Debian base by build.sh.
# Debian's python3 lives in /usr/bin; the official image's `python` is on PATH, and so
# is this one's. python3-venv brings ensurepip, so `python -m venv` gives a venv with pip.
ARG BASE_IMAGE=localhost/tokembed-local/debian:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && ln -s /usr/bin/python3 /usr/local/bin/python \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb
CMD ["python3"]
