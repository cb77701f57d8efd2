//! How the sidecar talks to engines itself (probes, metrics scrapes): one
//! HTTP client that carries the engines' credentials. The key goes only
//! into the `Authorization` header; it is never logged. Engines written
//! `https://ip:port` in the replica list are reached over TLS (rustls),
//! their certificates checked against `HEARTH_ENGINE_CA_FILE` when set,
//! else the system's roots; a certificate must name the engine's IP.

use std::time::Duration;

use serde_json::Value;

use crate::config::Secret;
use crate::envoy::render::ENGINE_IDLE_SECONDS;

#[derive(Clone)]
pub struct EngineClient {
    http: reqwest::Client,
    key: Option<Secret>,
}

impl EngineClient {
    /// A client sending `key`; `ca_pem`: the only CA certificates
    /// `https://` engines may chain to (PEM, one or more), or `None` for
    /// the system's roots.
    pub fn new(key: Option<Secret>, ca_pem: Option<&[u8]>) -> Result<EngineClient, String> {
        // A connection idle for a few seconds is closed here, before the
        // engine's own keep-alive (5 s in vLLM, SGLang and llama.cpp)
        // can close it just as a probe or a scrape goes out on it: the
        // interval that matches it (a scrape every 5 s) would otherwise
        // race it on every request. Envoy's pool does the same
        // (`ENGINE_IDLE_SECONDS`).
        let mut builder = reqwest::Client::builder()
            .pool_max_idle_per_host(1)
            .pool_idle_timeout(Duration::from_secs(ENGINE_IDLE_SECONDS))
            .use_rustls_tls();
        if let Some(pem) = ca_pem {
            let roots = reqwest::Certificate::from_pem_bundle(pem)
                .map_err(|e| format!("HEARTH_ENGINE_CA_FILE: not a PEM certificate bundle: {e}"))?;
            builder = builder.tls_built_in_root_certs(false);
            for cert in roots {
                builder = builder.add_root_certificate(cert);
            }
        }
        let http = builder
            .build()
            .map_err(|e| format!("the engines' HTTP client: {e}"))?;
        Ok(EngineClient { http, key })
    }

    fn authorize(&self, req: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.key {
            Some(key) => req.bearer_auth(key.expose()),
            None => req,
        }
    }

    pub async fn get(&self, url: &str, timeout: Duration) -> reqwest::Result<reqwest::Response> {
        self.authorize(self.http.get(url).timeout(timeout))
            .send()
            .await
    }

    pub async fn post(
        &self,
        url: &str,
        body: &Value,
        header: Option<&(&str, String)>,
        timeout: Duration,
    ) -> reqwest::Result<reqwest::Response> {
        let mut req = self.http.post(url).timeout(timeout).json(body);
        if let Some((name, value)) = header {
            req = req.header(*name, value.as_str());
        }
        self.authorize(req).send().await
    }
}
