//! Prometheus metrics over HTTP: `GET /metrics` answers the text exposition
//! format (version 0.0.4), rendered on each request by the server that
//! owns the numbers. Hand-written on purpose: one endpoint, one verb and a
//! few dozen lines do not justify an HTTP stack; everything is bounded (the
//! request head to 8 KiB, each connection to 5 s) and every connection is
//! answered and closed. A connection whose request has not arrived is a
//! pending one of the endpoint's `blizzard_env::admission` (issue 56):
//! peers that connect and send nothing hold no place anyone waits for.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use blizzard_env::admission::{Admission, AdmissionLimits, Pending};
use blizzard_env::{Env, Listener};

/// Longest request head read before answering.
const HEAD_MAX: usize = 8 << 10;
/// Longest a client may take to send its request.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(5);

/// Builds the text exposition: each metric family once, with its help and
/// type, then its samples.
#[derive(Default)]
pub struct Text {
    out: String,
}

impl Text {
    pub fn new() -> Text {
        Text::default()
    }

    fn family(&mut self, name: &str, help: &str, kind: &str) {
        let _ = writeln!(self.out, "# HELP {name} {help}");
        let _ = writeln!(self.out, "# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) {
        self.out.push_str(name);
        if !labels.is_empty() {
            self.out.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                let v = v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n");
                let _ = write!(self.out, "{k}=\"{v}\"");
            }
            self.out.push('}');
        }
        let _ = writeln!(self.out, " {value}");
    }

    pub fn gauge(&mut self, name: &str, help: &str, value: f64) -> &mut Self {
        self.family(name, help, "gauge");
        self.sample(name, &[], value);
        self
    }

    pub fn counter(&mut self, name: &str, help: &str, value: f64) -> &mut Self {
        self.family(name, help, "counter");
        self.sample(name, &[], value);
        self
    }

    /// One gauge family with a sample per label set.
    pub fn gauges(&mut self, name: &str, help: &str, samples: &[(&[(&str, &str)], f64)]) -> &mut Self {
        self.family(name, help, "gauge");
        for (labels, v) in samples {
            self.sample(name, labels, *v);
        }
        self
    }

    /// One counter family with a sample per label set.
    pub fn counters(&mut self, name: &str, help: &str, samples: &[(&[(&str, &str)], f64)]) -> &mut Self {
        self.family(name, help, "counter");
        for (labels, v) in samples {
            self.sample(name, labels, *v);
        }
        self
    }

    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.out)
    }
}

/// What renders the current metrics.
pub type Render = Arc<dyn Fn() -> String + Send + Sync>;

/// Serves `GET /metrics` on `listener` until `stop` resolves.
pub async fn serve(
    env: Env,
    listener: Box<dyn Listener>,
    render: Render,
    stop: impl std::future::Future<Output = ()>,
) {
    tokio::pin!(stop);
    let admission = Admission::new(AdmissionLimits::with_deadline(CLIENT_TIMEOUT));
    loop {
        let accepted = tokio::select! {
            biased;
            _ = &mut stop => return,
            a = listener.accept() => a,
        };
        match accepted {
            Ok((stream, peer)) => {
                let (env, render, admission) = (env.clone(), render.clone(), admission.clone());
                tokio::spawn(async move {
                    if let Err(e) = answer(&env, stream, &peer, &admission, &render).await {
                        tracing::debug!(%peer, error = %e, "metrics request failed");
                    }
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "metrics endpoint cannot accept; pausing");
                if !admission.evict_one() {
                    env.sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }
}

/// Reads a request head: up to the blank line, [`HEAD_MAX`] bytes or the
/// end of the stream, whichever comes first.
async fn read_head(s: &mut blizzard_env::BoxStream, pending: &Pending) -> std::io::Result<Vec<u8>> {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < HEAD_MAX {
        let n = s.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        pending.heard();
        head.extend_from_slice(&buf[..n]);
    }
    Ok(head)
}

async fn answer(
    env: &Env,
    mut s: blizzard_env::BoxStream,
    peer: &str,
    admission: &Arc<Admission>,
    render: &Render,
) -> std::io::Result<()> {
    let pending = admission.admit(peer);
    let head = pending.run(&*env.clock, read_head(&mut s, &pending)).await;
    drop(pending);
    let head = match head {
        Ok(r) => r?,
        // Silent past the deadline, or pushed out by newer connections.
        Err(_) => return Ok(()),
    };
    let line = head.split(|b| *b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let (status, kind, body) = if method != "GET" {
        ("405 Method Not Allowed", "text/plain", "only GET is served here\n".to_string())
    } else if path == "/metrics" || path.starts_with("/metrics?") {
        ("200 OK", "text/plain; version=0.0.4; charset=utf-8", render())
    } else {
        ("404 Not Found", "text/plain", "metrics are at /metrics\n".to_string())
    };
    let resp = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(resp.as_bytes()).await?;
    s.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn get(env: &Env, addr: &str, path: &str) -> String {
        let mut s = env.connect(addr).await.expect("connect");
        s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes()).await.expect("send");
        let mut out = String::new();
        s.read_to_string(&mut out).await.expect("read");
        out
    }

    /// The endpoint answers the exposition format at /metrics and a clear
    /// 404 or 405 elsewhere, and a silent client does not hold it up.
    #[tokio::test]
    async fn serves_the_text_format() {
        let env = Env::real();
        let listener = env.bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr();
        let render: Render = Arc::new(|| {
            Text::new()
                .gauge("blizzard_test_gauge", "A gauge.", 2.5)
                .counter("blizzard_test_total", "A counter.", 7.0)
                .gauges("blizzard_test_state", "By state.", &[(&[("state", "up\"x")], 3.0)])
                .finish()
        });
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(env.clone(), listener, render, async {
            let _ = rx.await;
        }));
        let _silent = env.connect(&addr).await.expect("connect");
        let r = get(&env, &addr, "/metrics").await;
        assert!(r.starts_with("HTTP/1.1 200 OK\r\n"), "{r}");
        assert!(r.contains("# TYPE blizzard_test_gauge gauge\nblizzard_test_gauge 2.5\n"), "{r}");
        assert!(r.contains("blizzard_test_total 7\n"), "{r}");
        assert!(r.contains("blizzard_test_state{state=\"up\\\"x\"} 3\n"), "{r}");
        assert!(get(&env, &addr, "/other").await.starts_with("HTTP/1.1 404"));
        let mut s = env.connect(&addr).await.expect("connect");
        s.write_all(b"POST /metrics HTTP/1.1\r\n\r\n").await.expect("send");
        let mut out = String::new();
        s.read_to_string(&mut out).await.expect("read");
        assert!(out.starts_with("HTTP/1.1 405"), "{out}");
        let _ = tx.send(());
        server.await.expect("server");
    }
}
