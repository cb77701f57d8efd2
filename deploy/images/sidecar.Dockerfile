# The ext_proc sidecar. Build from the repository root:
#   docker build -f deploy/images/sidecar.Dockerfile -t hearth-ext-proc:0.1.0 .
FROM rust:1.88-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p hearth-ext-proc

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/hearth-ext-proc /usr/local/bin/hearth-ext-proc
# gRPC (ext_proc) and the admin endpoint (/state, /metrics, /outcome).
EXPOSE 50051 9190
USER nonroot
ENTRYPOINT ["/usr/local/bin/hearth-ext-proc"]
