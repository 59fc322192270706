//! Reaching an S3-compatible store from a URL the operator types:
//! `http://host:port/bucket/prefix` (path-style, e.g. SeaweedFS or MinIO),
//! `https://host/bucket/prefix`, or `s3://bucket/prefix` (AWS itself).
//! Credentials and region come from the standard `AWS_*` environment
//! variables (`AmazonS3Builder::from_env`); the region defaults to
//! `us-east-1`, which S3-compatible servers accept.
//!
//! Requests give up after a short, bounded retry (connect timeout 5 s, at
//! most 4 retries within 20 s): an unreachable endpoint is a one-line error
//! at create or open, not minutes of silence. The destager retries on its
//! own, forever, while the volume is served.

use std::sync::Arc;
use std::time::Duration;

use object_store::aws::AmazonS3Builder;
use object_store::{BackoffConfig, ClientOptions, ObjectStore, RetryConfig};

use crate::error::LsvdError;

/// Where a volume lives: an object store and the prefix in it.
pub struct Location {
    pub store: Arc<dyn ObjectStore>,
    pub bucket: String,
    pub prefix: String,
}

/// The parts of a URL: (endpoint or `None` for AWS, bucket, prefix).
pub fn parse(url: &str) -> Result<(Option<String>, String, String), LsvdError> {
    let bad = |why: &str| {
        LsvdError::Invalid(format!(
            "S3 URL {url:?}: {why} (like http://127.0.0.1:8333/bucket/prefix or s3://bucket/prefix)"
        ))
    };
    let (scheme, rest) = url.split_once("://").ok_or_else(|| bad("no scheme"))?;
    let (endpoint, path) = match scheme {
        "http" | "https" => {
            let (host, path) = rest.split_once('/').ok_or_else(|| bad("no bucket"))?;
            if host.is_empty() {
                return Err(bad("no host"));
            }
            (Some(format!("{scheme}://{host}")), path)
        }
        "s3" => (None, rest),
        _ => return Err(bad("the scheme must be http, https or s3")),
    };
    let path = path.trim_matches('/');
    let (bucket, prefix) = path.split_once('/').unwrap_or((path, ""));
    if bucket.is_empty() {
        return Err(bad("no bucket"));
    }
    if prefix.split('/').any(|s| s.is_empty() || s == "." || s == "..") && !prefix.is_empty() {
        return Err(bad("empty, '.' or '..' segments in the prefix"));
    }
    Ok((endpoint, bucket.to_string(), prefix.to_string()))
}

/// Makes ring the process's rustls cryptography (object_store's HTTP
/// client is built without one: workspace Cargo.toml), unless the program
/// installed a provider already. Needed for `http://` endpoints too: the
/// client is set up for TLS when it is built.
pub fn install_tls_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// Builds the store a URL names, with credentials from the environment.
pub fn open(url: &str) -> Result<Location, LsvdError> {
    open_with_keys(url, None)
}

/// [`open`] with the credentials given (key id, secret) instead of the
/// environment's (tests: the environment is shared by threads).
pub fn open_with_keys(url: &str, keys: Option<(&str, &str)>) -> Result<Location, LsvdError> {
    let (endpoint, bucket, prefix) = parse(url)?;
    install_tls_provider();
    let retry = RetryConfig {
        backoff: BackoffConfig {
            init_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(2),
            base: 2.0,
        },
        max_retries: 4,
        retry_timeout: Duration::from_secs(20),
    };
    let client = ClientOptions::new()
        .with_connect_timeout(Duration::from_secs(5))
        .with_timeout(Duration::from_secs(60));
    // Client options first: `with_allow_http` sets one of them.
    let mut b =
        AmazonS3Builder::from_env().with_client_options(client).with_retry(retry).with_bucket_name(&bucket);
    if let Some((id, secret)) = keys {
        b = b.with_access_key_id(id).with_secret_access_key(secret);
    }
    if std::env::var_os("AWS_REGION").is_none() && std::env::var_os("AWS_DEFAULT_REGION").is_none() {
        b = b.with_region("us-east-1");
    }
    if let Some(e) = &endpoint {
        b = b
            .with_endpoint(e)
            .with_allow_http(e.starts_with("http://"))
            .with_virtual_hosted_style_request(false);
    }
    let store = b.build().map_err(|e| LsvdError::Invalid(format!("S3 URL {url:?}: {e}")))?;
    Ok(Location { store: Arc::new(store), bucket, prefix })
}

#[cfg(test)]
mod tests {
    use super::*;

    // URLs split into endpoint, bucket and prefix; malformed ones are
    // refused with a message showing the expected shape.
    #[test]
    fn urls_parse_or_are_refused() {
        assert_eq!(
            parse("http://127.0.0.1:8333/b/vols/disk").ok(),
            Some((Some("http://127.0.0.1:8333".into()), "b".into(), "vols/disk".into()))
        );
        assert_eq!(parse("s3://b").ok(), Some((None, "b".into(), String::new())));
        for bad in ["127.0.0.1/b", "ftp://h/b", "http://h", "http:///b", "http://h/b/x//y", "http://h/b/../y"]
        {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }
}
