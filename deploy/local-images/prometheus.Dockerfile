# Local stand-in for prom/prometheus, from Debian's prometheus package, built by build.sh.
# Same entrypoint, default arguments, user and data directory as the official image, so
# the compose file's `prometheus` service runs unchanged on it.
ARG BASE_IMAGE=localhost/tokembed-local/debian:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends prometheus \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb \
    && mkdir -p /prometheus \
    && chown nobody:nogroup /prometheus
USER nobody
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
