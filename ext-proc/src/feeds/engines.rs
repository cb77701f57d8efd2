//! How the sidecar talks to engines itself (probes, metrics scrapes): one
//! HTTP client that carries the engines' credentials. The key goes only
//! into the `Authorization` header; it is never logged.

use std::time::Duration;

use serde_json::Value;

use crate::config::Secret;

#[derive(Clone)]
pub struct EngineClient {
    http: reqwest::Client,
    key: Option<Secret>,
}

impl EngineClient {
    pub fn new(key: Option<Secret>) -> EngineClient {
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(1)
            .build()
            .unwrap_or_default();
        EngineClient { http, key }
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
