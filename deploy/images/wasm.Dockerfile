# filter-wasm as an OCI artifact: one layer holding plugin.wasm, the layout
# Istio and Envoy Gateway fetch wasm images in. Build from the repository
# root:
#   docker build -f deploy/images/wasm.Dockerfile -t hearth-filter-wasm:0.1.0 .
FROM rust:1.88-bookworm AS build
WORKDIR /src
COPY . .
RUN rustup target add wasm32-wasip1 \
 && cargo build --locked -p hearth-filter --target wasm32-wasip1 --profile wasm-release

FROM scratch
COPY --from=build /src/target/wasm32-wasip1/wasm-release/hearth_filter.wasm /plugin.wasm
